"""The GPU path, as far as a CPU allows: bf16 learner (CPU autocast), behaviour/learner
mismatch metrics, vLLM backend selection without vLLM. The `gpu`-marked tests at the end
run the CUDA paths (bf16 learner on CUDA, vLLM groups with log-probs, hot reload) and are
skipped without a CUDA device; benchmarks/gpu_check.sh runs them on a GPU machine.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from gagpo.learner.batching import plan
from gagpo.learner.config import LearnerConfig, LossSettings
from gagpo.learner.loss import gagpo_loss
from gagpo.learner.metrics import read_metrics
from gagpo.learner.model import action_logprobs, load_model
from gagpo.learner.precision import autocast_dtype
from gagpo.learner.train import train
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import (
    GROUP_SIZE,
    ROOT,
    parameters,
    shard_table,
    tiny_config,
    tiny_model_dir,
    write_shards,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def micro_batches(table: pa.Table, version: int = 0):
    return plan(table, version=version, pad_id=0, max_positions=128, budget=4096, token_mean=False)


# --- bf16 -----------------------------------------------------------------------------


def test_bf16_autocast_loss_is_close_to_fp32_on_the_same_batch():
    model = load_model(tiny_model_dir(), torch.device("cpu")).train()
    table = shard_table("p0", groups=2)
    table = table.append_column(C.ADVANTAGE, pa.array(np.linspace(-1, 1, table.num_rows)))
    (mb,) = micro_batches(table)
    losses, logps = {}, {}
    for precision in ("fp32", "bf16"):
        model.zero_grad()
        logp, _ = action_logprobs(model, mb, 1.0, autocast_dtype=autocast_dtype(precision))
        loss, _ = gagpo_loss(
            logp, logp.detach(), mb.logp_behav, mb.action_mask, mb.advantages, LossSettings()
        )
        loss.backward()
        losses[precision], logps[precision] = float(loss.detach()), logp.detach()
        # master weights and their gradients stay float32 under autocast
        assert all(
            p.dtype == torch.float32 and p.grad.dtype == torch.float32
            for p in model.parameters()
            if p.grad is not None
        )
    assert logps["bf16"].dtype == torch.float32  # the log-softmax is taken in float32
    assert not torch.equal(logps["bf16"], logps["fp32"])  # autocast did run in bf16
    mask = mb.action_mask
    assert (logps["bf16"] - logps["fp32"])[mask].abs().max() < 0.1
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05, abs=0.01)
    assert autocast_dtype("bf16", sharded=True) is None  # FSDP casts through its policy


def test_bf16_learner_trains_and_publishes_float32_weights_when_asked(tmp_path: Path):
    """bf16 training publishes bf16 by default (tests/test_publish_state.py); fp32 stays a
    setting, and then every published tensor is the float32 master."""
    store = Store(str(tmp_path / "store"))
    write_shards(store, 2)
    cfg = tiny_config(store, precision="bf16", device="cpu", publish_dtype="fp32")
    assert train(cfg).updates == 2
    metrics = read_metrics(store)
    assert np.isfinite(metrics["loss"].to_numpy()).all() and (metrics["skipped_steps"] == 0).all()
    before, after = parameters(tiny_model_dir()), parameters(store.policies.dir(2))
    assert all(after[k].dtype == np.float32 for k in after)
    assert any(not np.array_equal(before[k], after[k]) for k in before)


# --- behaviour/learner mismatch --------------------------------------------------------


def recomputed_behaviour(table: pa.Table) -> pa.Table:
    """The table with behaviour log-probs recomputed by the base model (what a perfect
    engine at the same version would have recorded)."""
    model = load_model(tiny_model_dir(), torch.device("cpu")).eval()
    prompts, actions = table[C.PROMPT_IDS].to_pylist(), table[C.ACTION_IDS].to_pylist()
    behav = []
    with torch.no_grad():
        for prompt, action in zip(prompts, actions, strict=True):
            ids = torch.tensor([prompt + action])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(action) - 1)
            behav.append(logp[positions, torch.tensor(action)].tolist())
    i = table.schema.get_field_index(C.BEHAVIOR_LOGPROBS)
    return table.set_column(i, table.schema.field(i), pa.array(behav, pa.list_(pa.float32())))


def test_mismatch_is_measured_on_same_version_actions_and_null_otherwise(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    exact = recomputed_behaviour(shard_table("m0", groups=2, version=0))
    store.write_shard(exact, group_size=GROUP_SIZE)  # update 1 (learner at v0): same version
    write_shards(store, 1, version=0, prefix="n")  # update 2 (learner at v1): one behind
    cfg = tiny_config(store, max_staleness=4, device="cpu")
    assert train(cfg).updates == 2
    metrics = read_metrics(store).sort("update")
    kl, max_abs = metrics["mismatch_kl"].to_list(), metrics["mismatch_max_abs"].to_list()
    assert 0.0 <= kl[0] < 1e-8 and max_abs[0] < 1e-4  # the same policy, recomputed: agreement
    assert kl[1] is None and max_abs[1] is None  # no action of the learner's version


def test_mismatch_grows_with_the_gap(tmp_path: Path):
    """Recorded log-probs that disagree with the learner show up as KL and max |Δ|."""
    from gagpo.learner.update import _mismatch

    table = recomputed_behaviour(shard_table("g0", groups=1, version=0))
    (mb,) = micro_batches(table.append_column(C.ADVANTAGE, pa.array([0.0] * table.num_rows)))
    logp = mb.logp_behav.clone()
    sums = {"mismatch_kl": 0.0, "mismatch_tokens": 0.0}
    assert float(_mismatch(sums, mb, logp)) == 0.0 and sums["mismatch_kl"] == 0.0
    assert sums["mismatch_tokens"] == int(mb.action_mask.sum())
    shifted = torch.where(mb.action_mask, logp - 0.3, logp)
    sums = {"mismatch_kl": 0.0, "mismatch_tokens": 0.0}
    assert float(_mismatch(sums, mb, shifted)) == pytest.approx(0.3, abs=1e-5)
    # k3 at log r = −0.3 per token: e^−0.3 − 1 + 0.3
    per_token = sums["mismatch_kl"] / sums["mismatch_tokens"]
    assert per_token == pytest.approx(np.expm1(-0.3) + 0.3, rel=1e-5)


# --- the vLLM backend without vLLM ----------------------------------------------------


def test_vllm_backend_module_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # importing vllm now fails, as if absent
        "import gagpo.actors.policies.vllm_backend as m\n"
        "assert hasattr(m, 'VLLMPolicy') and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_backend_vllm_without_vllm_is_one_line(tmp_path: Path):
    code = "import sys; sys.modules['vllm'] = None\nfrom gagpo.actors.cli import main; main()\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--store",
            str(tmp_path / "s"),
            "--backend",
            "vllm",
            "--groups",
            "1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "vllm" in lines[0] and "gagpo[vllm]" in lines[0]


def test_auto_backend_is_transformers_without_a_gpu_or_vllm():
    from gagpo.actors.policies.presets import resolve_backend

    assert resolve_backend("transformers", "auto") == "transformers"
    assert resolve_backend("auto", "cpu") == "transformers"
    if not torch.cuda.is_available():
        assert resolve_backend("auto", "auto") == "transformers"


class FakeVllm:
    """Stands in for the vllm package (absent here) to check what the backend asks of the
    engine and how it reads the answer; the engine itself is checked by the gpu tests."""

    def __init__(self):
        import types

        self.module = types.ModuleType("vllm")
        fake = self

        class SamplingParams:
            def __init__(self, **kwargs):
                self.__dict__.update(kwargs)

        class LLM:
            def __init__(self, **kwargs):
                fake.options, fake.calls = kwargs, []
                self.llm_engine = types.SimpleNamespace(
                    model_config=types.SimpleNamespace(max_model_len=4096)
                )

            def generate(self, prompts, params, use_tqdm=True, lora_request=None):
                fake.calls.append(("generate", prompts, params, lora_request))
                outs = []
                for p in params:  # a reply of 3 tokens drawn from the request's seed
                    ids = [5 + (p.seed + k) % 7 for k in range(3)]
                    entries = [
                        {t: types.SimpleNamespace(logprob=-0.5 * (k + 1))}
                        for k, t in enumerate(ids)
                    ]
                    completion = types.SimpleNamespace(token_ids=ids, logprobs=entries)
                    outs.append(types.SimpleNamespace(outputs=[completion]))
                return outs

            def collective_rpc(self, method, args=()):
                fake.calls.append(("rpc", method, args))

            def reset_prefix_cache(self):
                fake.calls.append(("reset_prefix_cache",))

        class LoRARequest:
            def __init__(self, name, lora_id, path):
                self.name, self.lora_id, self.path = name, lora_id, path

        self.module.LLM, self.module.SamplingParams = LLM, SamplingParams
        lora = types.ModuleType("vllm.lora")
        request = types.ModuleType("vllm.lora.request")
        request.LoRARequest = LoRARequest
        platforms = types.ModuleType("vllm.platforms")  # a GPU platform
        platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
        self.modules = {
            "vllm": self.module,
            "vllm.lora": lora,
            "vllm.lora.request": request,
            "vllm.platforms": platforms,
        }


def test_vllm_backend_asks_for_tempered_logprobs_seeds_a_group_and_reloads(monkeypatch, tmp_path):
    from gagpo.actors.config import SamplingConfig, VllmSettings
    from gagpo.actors.policies.presets import load_policy, load_version, tiny_dir
    from gagpo.actors.policies.vllm_backend import WeightLoader

    fake = FakeVllm()
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=8)
    policy = load_policy(
        "tiny",
        backend="vllm",
        sampling=sampling,
        stop=("\n", "."),
        vllm=VllmSettings(enable_lora=True),
    )
    o = fake.options
    assert o["logprobs_mode"] == "processed_logprobs" and o["enable_prefix_caching"]
    assert o["generation_config"] == "vllm" and o["enable_lora"]
    assert "enable_chunked_prefill" not in o  # vLLM's own scheduling on a GPU (CPU: off)
    module, _, name = o["worker_extension_cls"].rpartition(".")  # vLLM's workers import it
    assert getattr(importlib.import_module(module), name) is WeightLoader
    prompt = policy.encode_chat([{"role": "user", "content": "look"}])
    samples = policy.generate([prompt] * 4, seed=11)
    ((_, prompts, params, lora),) = fake.calls  # one engine call for the whole group
    assert [p["prompt_token_ids"] for p in prompts] == [prompt] * 4
    assert len({p.seed for p in params}) == 4  # the G rollouts differ, reproducibly
    assert all(p.temperature == 0.7 and p.top_p == 1.0 and p.logprobs == 0 for p in params)
    assert params[0].stop == ["\n", "."] and lora is None
    assert samples[0].logprobs == [-0.5, -1.0, -1.5] and len(samples[0].token_ids) == 3
    again = policy.generate([prompt] * 4, seed=11)
    assert [s.token_ids for s in samples] == [s.token_ids for s in again]

    same = load_version(policy, tiny_dir(), 1)  # full weights: in place, prefix cache reset
    assert same is policy and policy.version == 1
    assert ("rpc", "gagpo_load_weights", (str(tiny_dir()),)) in fake.calls
    assert fake.calls[-1] == ("reset_prefix_cache",)
    adapter = tmp_path / "v2"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    load_version(policy, adapter, 2)
    policy.generate([prompt], seed=0)
    lora = fake.calls[-1][3]
    assert lora.path == str(adapter) and lora.lora_id >= 1 and policy.version == 2
    with pytest.raises(GagpoError, match="top_p"):
        load_policy("tiny", backend="vllm", sampling=SamplingConfig(top_p=0.9))


def test_weight_loader_streams_every_tensor_of_a_published_folder():
    """The worker-side half of a hot reload, on CPU: every tensor of the folder reaches
    the model's `load_weights`, by name."""
    import types

    from safetensors import safe_open

    from gagpo.actors.policies.presets import tiny_dir
    from gagpo.actors.policies.vllm_backend import WeightLoader

    received = {}

    class Model:
        def load_weights(self, weights):
            received.update(dict(weights))

    worker = WeightLoader()
    worker.model_runner = types.SimpleNamespace(model=Model())
    count = worker.gagpo_load_weights(str(tiny_dir()))
    with safe_open(str(next(tiny_dir().glob("*.safetensors"))), framework="pt") as f:
        names = set(f.keys())
    assert set(received) == names and count == len(names)


RECIPE = ROOT / "workflows" / "recipes" / "gpu-alfworld.toml"


def test_gpu_recipe_is_the_papers_setup_and_refuses_an_absent_model_in_one_line(tmp_path):
    from gagpo.actors.config import ActorConfig
    from gagpo.schemas.config import load_config

    actors = load_config(ActorConfig, RECIPE, section="actors", overrides={"store": "s"})
    learner = load_config(LearnerConfig, RECIPE, section="learner", overrides={"store": "s"})
    assert actors.policy == learner.policy == "Qwen/Qwen2.5-1.5B-Instruct"
    assert actors.env == "alfworld" and actors.group_size == 8 and actors.backend == "vllm"
    assert learner.precision == "bf16" and learner.estimator.estimator == "gagpo"
    assert actors.sampling.temperature == learner.temperature and actors.sampling.top_p == 1.0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.actors.cli",
            "--config",
            str(RECIPE),
            "--store",
            str(tmp_path / "s"),
            "--env",
            "household",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-cache")},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct" in line and "empty-cache" in line


# --- on a CUDA machine (benchmarks/gpu_check.sh) --------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_learner_trains(tmp_path: Path):
    store = Store(str(tmp_path / "store"))
    write_shards(store, 2)
    cfg = tiny_config(store, precision="bf16", device="cuda")
    assert train(cfg).updates == 2
    assert np.isfinite(read_metrics(store)["loss"].to_numpy()).all()


def _vllm_policy(model_dir, **kwargs):
    pytest.importorskip("vllm")
    from gagpo.actors.config import SamplingConfig
    from gagpo.actors.policies.vllm_backend import VLLMPolicy

    sampling = SamplingConfig(temperature=0.7, max_new_tokens=16)
    return VLLMPolicy(model_dir, sampling=sampling, **kwargs)


@pytest.mark.gpu
@needs_cuda
def test_vllm_group_logprobs_match_a_recomputation_and_hot_reload(tmp_path: Path):
    """One group in one call; its log-probs are log_softmax(logits / T) of the sampled
    tokens (checked against a float32 transformers recomputation); a newly published
    version is loaded into the running engine and changes what it samples."""
    from transformers import AutoModelForCausalLM

    from gagpo.actors.policies.presets import tiny_dir
    from tests.helpers.publication import publish

    folder = tiny_dir()
    policy = _vllm_policy(folder, gpu_memory_utilization=0.3)
    prompt = policy.encode_chat([{"role": "user", "content": "go north"}])
    samples = policy.generate([prompt] * 8, seed=5)
    assert len(samples) == 8 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in samples)
    assert samples == policy.generate([prompt] * 8, seed=5)  # seeded
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    for s in samples[:4]:
        ids = torch.tensor([prompt + s.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert torch.allclose(ref.cpu(), torch.tensor(s.logprobs), atol=0.05)

    store = Store(str(tmp_path / "store"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    publish(store, model.cpu(), folder, 1)
    engine = policy.engine
    policy.load_version(Path(store.policies.dir(1)), 1)
    assert policy.engine is engine and policy.version == 1  # same engine, new weights
    assert policy.generate([prompt] * 8, seed=5) != samples
