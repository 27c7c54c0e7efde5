"""A transformers backend: batched sampling with the log-probability of every sampled token.

The sampling loop is written out here rather than delegated to `model.generate` so that
what is recorded is exactly what was sampled from, seeding does not touch torch's global
RNG, and a reply stops at the end of its line.

Recorded log-probabilities. Token y_k is drawn from softmax(logits_k / T), optionally
restricted to the nucleus of mass `top_p`. We record log_softmax(logits_k / T)[y_k] — the
tempered distribution over the full vocabulary. With top_p = 1 that is exactly the
sampling distribution. With top_p < 1 the distribution actually sampled from is that one
renormalised over the nucleus, whose log-prob is larger by -log(nucleus mass); we record
the un-truncated value because it is the one the learner can recompute from logits alone,
so its importance ratios compare like with like.

Prompts are batched by length with left padding; a prefix common to the whole batch (a
group's prompts are identical at its first turn and share the system prompt after it)
is run once and its cache shared, which on CPU is most of the cost of a turn.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from gagpo.actors.policies.base import Sample, SamplingConfig, prompt_budget
from gagpo.actors.policies.folders import (
    chat_prompt_ids,
    check_model_dir,
    load_chat_tokenizer,
    quiet_transformers,
)
from gagpo.schemas.config import gpu_memory_share
from gagpo.schemas.errors import GagpoError


def resolve_device(device: str) -> torch.device:
    """'auto' → cuda when available, else cpu; an unavailable cuda is the user's to fix."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise GagpoError(
            f"device {device!r} is not valid; accepted: auto, cpu, cuda, cuda:N"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise GagpoError(
            f"device {device!r} requested but no CUDA device is visible; accepted: auto, cpu"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise GagpoError(f"device {device!r} is not supported; accepted: auto, cpu, cuda, cuda:N")
    return resolved


# A shared prompt prefix shorter than this is not worth a separate forward pass.
MIN_SHARED_PREFIX = 16


def common_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens all prompts start with, leaving each at least one token of its own (the
    last prompt token's logits are needed per row)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    length = 0
    while length < limit and all(p[length] == first[length] for p in prompts):
        length += 1
    return length


class HFPolicy:
    """A Hugging Face causal LM loaded from a local folder (CPU float32 unless
    `sampling.cpu_dtype` says bf16; CUDA bfloat16)."""

    # A reply is one command and ends with its line; agents' replies span lines (the actor
    # turns this off for environments whose `stop_strings` are empty: envs/agent.py).
    stop_at_newline = True

    def __init__(
        self,
        model_dir: Path,
        *,
        version: int = 0,
        sampling: SamplingConfig | None = None,
        device: str = "auto",
    ) -> None:
        model_dir = Path(model_dir)
        check_model_dir(model_dir)
        self.model_dir = model_dir
        self.version = version
        self.sampling = sampling or SamplingConfig()
        self.device = resolve_device(device)
        share = gpu_memory_share()  # set by `gagpo run` on a GPU it shares (workflows/layout.py)
        if self.device.type == "cuda" and share is not None and share < 1.0:
            # torch wants an index here: plain "cuda" is the current device.
            index = (
                self.device.index if self.device.index is not None else torch.cuda.current_device()
            )
            torch.cuda.set_per_process_memory_fraction(share, index)
        cpu_bf16 = self.sampling.cpu_dtype == "bf16"
        self.dtype = torch.float32 if self.device.type == "cpu" and not cpu_bf16 else torch.bfloat16

        self.tokenizer = load_chat_tokenizer(model_dir)
        with quiet_transformers():
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, local_files_only=True, use_safetensors=True, dtype=self.dtype
            )
        self.model.to(self.device).eval()
        accepted = inspect.signature(self.model.forward).parameters
        self._keep_last_logits = "logits_to_keep" in accepted
        # transformers 5.x renamed `past_key_values` to `cache`; accept either.
        self._cache_arg = "cache" if "cache" in accepted else "past_key_values"

        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        # The model's context; a prompt and its reply must fit in it (actors/rollout.py).
        self.context = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        self.prompt_budget = prompt_budget(self.sampling, self.context)
        self._newline, self._visible = self._token_classes()

    # -- setup -------------------------------------------------------------------------

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            for i in source if isinstance(source, list) else [source]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        if not ids:
            raise GagpoError(
                f"model folder '{self.model_dir}' defines no EOS token; accepted: a tokenizer with eos_token"
            )
        return ids

    def _token_classes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per vocabulary id: does its text hold a newline / a visible character?

        A reply stops at the first newline that follows visible text, so a leading blank
        line does not end it. Tokenizers that cannot produce a newline (word-level) stop
        at EOS or max_new_tokens only.
        """
        size = self.model.get_output_embeddings().weight.shape[0]
        known = min(size, len(self.tokenizer))
        texts = self.tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=True)
        newline = torch.zeros(size, dtype=torch.bool)
        visible = torch.zeros(size, dtype=torch.bool)
        newline[:known] = torch.tensor(["\n" in t for t in texts])
        visible[:known] = torch.tensor([bool(t.strip()) for t in texts])
        return newline.to(self.device), visible.to(self.device)

    # -- interface ---------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], tools=None) -> list[int]:
        """Chat template + generation prompt, whole (never cut: see `prompt_budget`)."""
        return chat_prompt_ids(self.tokenizer, messages, tools)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], *, seed: int | None = None, max_tokens=None
    ) -> list[Sample]:
        """One sample per prompt, in input order; prompts of similar length share a batch.
        `max_tokens`: each prompt's reply budget (None: `sampling.max_new_tokens`)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        default = self.sampling.max_new_tokens
        budgets = [default if b is None else b for b in (max_tokens or [None] * len(prompts))]
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding
        samples: list[Sample | None] = [None] * len(prompts)
        size = self.sampling.batch_size
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            batch = [prompts[i] for i in rows]
            for row, sample in zip(
                rows,
                self._generate_batch(batch, [budgets[i] for i in rows], generator),
                strict=True,
            ):
                samples[row] = sample
        return samples  # type: ignore[return-value]

    # -- sampling loop -----------------------------------------------------------------

    def _forward(self, input_ids, attention_mask, position_ids, past):
        extra = {"logits_to_keep": 1} if self._keep_last_logits else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_arg: past},
            **extra,
        )
        return out.logits[:, -1].float(), getattr(out, self._cache_arg)  # [B, V] in float32

    def _pick(self, logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Sample one id per row from exp(logprobs), restricted to the top_p nucleus."""
        probs = logprobs.exp()  # [B, V]
        top_p = self.sampling.top_p
        if top_p < 1.0:
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Drop tokens once the mass before them reaches top_p; the top token always stays.
            sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, sorted_ids, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [B]

    def _prefill(self, batch: list[list[int]]):
        """Run the prompts through the model: last-position logits, cache, mask, next position.

        The G prompts of a group are identical at its first turn and share the system
        prompt after that, so a common prefix is run once and its cache copied to every
        row; each row's own suffix follows, left-padded: [prefix][pad…][suffix].
        """
        rows = len(batch)
        shared = common_prefix_length(batch) if rows > 1 else 0
        past = None
        if shared < MIN_SHARED_PREFIX:
            shared = 0
        else:
            prefix = torch.tensor([batch[0][:shared]], device=self.device)
            positions = torch.arange(shared, device=self.device)[None]
            _, past = self._forward(prefix, torch.ones_like(prefix), positions, None)
            past.batch_repeat_interleave(rows)
        suffixes = [prompt[shared:] for prompt in batch]
        width = max(len(s) for s in suffixes)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, shared + width), dtype=torch.long)
        attention_mask[:, :shared] = 1
        for r, suffix in enumerate(suffixes):  # every prompt ends at the last column
            input_ids[r, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            attention_mask[r, shared + width - len(suffix) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # Positions count real tokens only, as in an unpadded forward pass.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        logits, past = self._forward(input_ids, attention_mask, position_ids, past)
        return logits, past, attention_mask, position_ids[:, -1:] + 1

    def _generate_batch(
        self, batch: list[list[int]], budgets: list[int], generator: torch.Generator
    ) -> list[Sample]:
        """Sample each row until EOS, its budget or (native replies) its line's end."""
        rows = len(batch)
        eos = torch.tensor(self.eos_ids, device=self.device)
        limit = torch.tensor(budgets, device=self.device)
        logits, past, attention_mask, next_position = self._prefill(batch)  # [B, V] … [B, 1]
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        started = torch.zeros(rows, dtype=torch.bool, device=self.device)
        tokens, logprobs, alive = [], [], []
        for step in range(max(budgets)):
            tempered = torch.log_softmax(logits / self.sampling.temperature, dim=-1)  # [B, V]
            token = self._pick(tempered, generator)  # [B]
            tokens.append(token)
            logprobs.append(tempered.gather(-1, token[:, None]).squeeze(-1))
            alive.append(~finished)
            started |= self._visible[token]
            stop = torch.isin(token, eos) | (limit <= step + 1)
            if self.stop_at_newline:
                stop |= self._newline[token] & started
            finished |= stop
            if bool(finished.all()):
                break
            token = token.masked_fill(finished, self.pad_id)  # finished rows idle on padding
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=-1)
            logits, past = self._forward(token[:, None], attention_mask, next_position, past)
            next_position = next_position + 1

        token_rows = torch.stack(tokens, dim=1).cpu().tolist()  # [B, steps]
        logprob_rows = torch.stack(logprobs, dim=1).cpu().tolist()
        alive_rows = torch.stack(alive, dim=1).cpu().tolist()
        samples = []
        for ids, lps, keep in zip(token_rows, logprob_rows, alive_rows, strict=True):
            ids = [t for t, k in zip(ids, keep, strict=True) if k]
            lps = [lp for lp, k in zip(lps, keep, strict=True) if k]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            samples.append(Sample(text=text, token_ids=ids, logprobs=lps))
        return samples
