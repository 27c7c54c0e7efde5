"""The `tiny` preset: a small randomly initialised Llama with a word-level vocabulary.

Its vocabulary is every word the registered environments' command grammars can produce,
plus chat and special tokens, digits and punctuation, so any admissible command is a
short token sequence and decodes back to itself (lowercased, punctuation spaced out).
Everything else becomes `<unk>`. It is saved as an ordinary Hugging Face folder and
loaded by the same backend as any other model — tests and CPU learning runs exercise
the real code path, only faster.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

# Bump when the folder layout or construction changes, so old caches are not reused.
TINY_FORMAT = 1
INIT_SEED = 20260513

UNK, PAD, BOS, EOS = "<unk>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, PAD, BOS, EOS]
CHAT_WORDS = ["system", "user", "assistant"]
DIGITS = [str(d) for d in range(10)]
PUNCTUATION = list(".,:;!?'\"()[]{}<>-_/#*+=|&%$@~^`\\")

# Whitespace in the template only separates words: the pre-tokenizer drops it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

MODEL_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    # Words split at whitespace, every punctuation character its own token.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )


def tiny_vocabulary(words: Iterable[str]) -> list[str]:
    """Special tokens first, then every lowercased piece of `words` as the tokenizer splits them."""
    split = _pre_tokenizer()
    pieces = set(CHAT_WORDS) | set(DIGITS) | set(PUNCTUATION)
    for word in words:
        pieces.update(piece for piece, _ in split.pre_tokenize_str(word.lower()))
    pieces -= set(SPECIAL_TOKENS)
    return SPECIAL_TOKENS + sorted(pieces)


def environment_words() -> list[str]:
    """The union of `vocabulary()` over every registered environment."""
    from gagpo.envs import ENVIRONMENTS

    words: set[str] = set()
    for env_cls in ENVIRONMENTS.values():
        words.update(env_cls.vocabulary())
    return sorted(words)


def tiny_key(vocab: list[str]) -> str:
    """Cache key: a hash of everything that shapes the saved folder."""
    blob = json.dumps(
        {
            "format": TINY_FORMAT,
            "seed": INIT_SEED,
            "vocab": vocab,
            "config": MODEL_CONFIG,
            "template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tiny_tokenizer(vocab: list[str]):
    """A real `PreTrainedTokenizerFast` over a WordLevel model, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = _pre_tokenizer()
    # With no "##" continuation pieces in the vocabulary this decoder joins words with spaces.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def write_tiny_model(vocab: list[str], folder: Path) -> None:
    """Initialise the model from INIT_SEED and save model + tokenizer into `folder`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {w: i for i, w in enumerate(vocab)}
    config = LlamaConfig(
        vocab_size=len(vocab),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):  # fixed weights, the caller's RNG untouched
        torch.manual_seed(INIT_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]
    )
    model.save_pretrained(folder)
    build_tiny_tokenizer(vocab).save_pretrained(folder)
