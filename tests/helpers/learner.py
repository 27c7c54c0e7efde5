"""The learner tests' tiny model folder, varied shards, and the learner as a process (its
command line, under torchrun too) or as a config."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from gagpo.learner.config import LearnerConfig
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.argv import flags
from tests.helpers.steps import make_steps

VOCAB = 48
GROUP_SIZE = 3
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@functools.cache
def tiny_model_dir() -> Path:
    """A randomly initialised 2-layer Llama (hidden 32) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(tempfile.mkdtemp(prefix="gagpo-tiny-learner-"))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.save_pretrained(folder)
    return folder


def shard_table(shard_id: str, *, groups: int = 2, version: int = 0, seed: int = 0) -> pa.Table:
    """Whole groups (G = 3) with varied prompts, actions and behaviour log-probs."""
    table = make_steps(
        shard_id=shard_id, groups=groups, group_size=GROUP_SIZE, policy_version=version
    )
    rng = np.random.default_rng([seed, *shard_id.encode()])
    n = table.num_rows
    p_len, a_len = rng.integers(3, 24, n), rng.integers(1, 6, n)
    prompts = [rng.integers(3, VOCAB, k).tolist() for k in p_len]
    actions = [rng.integers(3, VOCAB, k).tolist() for k in a_len]
    behav = [(-rng.uniform(2.5, 5.0, k)).tolist() for k in a_len]
    rewards = rng.uniform(0, 1, n).astype(np.float32)
    for name, values, kind in (
        (C.PROMPT_IDS, prompts, pa.list_(pa.int32())),
        (C.ACTION_IDS, actions, pa.list_(pa.int32())),
        (C.BEHAVIOR_LOGPROBS, behav, pa.list_(pa.float32())),
        (C.REWARD, rewards, pa.float32()),
    ):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, type=kind))
    return table


def write_shards(
    store: Store, count: int, *, groups: int = 2, version: int = 0, prefix: str = "s"
) -> list[str]:
    ids = [f"{prefix}{i:03d}" for i in range(count)]
    for shard_id in ids:
        store.write_shard(
            shard_table(shard_id, groups=groups, version=version), group_size=GROUP_SIZE
        )
    return ids


def learner_cmd(*args: str, **options) -> list[str]:
    """`gagpo-learner *args` and `options` as flags (`batch_groups=2` → `--batch-groups 2`)."""
    return [sys.executable, "-m", "gagpo.learner.cli", *args, *flags(**options)]


def run_torchrun(*args: str) -> subprocess.CompletedProcess:
    """`gagpo-learner *args` as 2 processes under torchrun on this machine."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*torchrun, "--nproc-per-node", "2", "-m", "gagpo.learner.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )


def run_learner(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        learner_cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def parameters(folder: str | Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def tiny_learner_args(store, *extra: str, **options) -> list[str]:
    """The learner's arguments on the tiny model: staleness up to 100, polls every 50 ms,
    stops once idle for a second, quiet; `options` as flags add or override; then `extra`."""
    defaults = {
        "policy": tiny_model_dir(),
        "max_staleness": 100,
        "poll_interval": 0.05,
        "idle_timeout": 1,
        "quiet": True,
    }
    return ["--store", str(store), *flags(**{**defaults, **options}), *extra]


def learner_args(store, *extra: str) -> list[str]:
    """A 3-update run on the tiny model that stops once idle for a second."""
    return tiny_learner_args(
        store, *extra, updates=3, batch_groups=3, lr=3e-3, micro_batch_tokens=64
    )


def learner_beside_actors(store, **options) -> list[str]:
    """`gagpo-learner` on the actors' `tiny` preset at lr 1e-3, polling every 0.1 s and
    waiting up to 2 minutes for the actors' groups; `options` as flags add or override."""
    from gagpo.actors.policies.presets import resolve_model

    defaults = {
        "policy": resolve_model("tiny"),
        "lr": 1e-3,
        "poll_interval": 0.1,
        "idle_timeout": 120,
        "quiet": True,
    }
    return learner_cmd(store=store, **{**defaults, **options})


def tiny_config(store: Store, **options) -> LearnerConfig:
    """Two updates of B = 2 at lr 1e-2 on the tiny model into `store`, stopping half a
    second after the data runs out; `options` add or override."""
    defaults = {
        "store": store.url,
        "policy": str(tiny_model_dir()),
        "updates": 2,
        "batch_groups": 2,
        "lr": 1e-2,
        "idle_timeout_s": 0.5,
        "poll_interval_s": 0.05,
    }
    return LearnerConfig(**{**defaults, **options})
