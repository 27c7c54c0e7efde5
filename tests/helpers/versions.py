"""A second policy version, and the log-probs a version's weights give a step."""

from __future__ import annotations

import shutil
from pathlib import Path


def perturbed_copy(src: Path, dst: Path) -> None:
    """A second policy version: the base weights plus noise (what a learner would publish)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        gen = torch.Generator().manual_seed(1)
        save_file(
            {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
            path,
            metadata={"format": "pt"},
        )
    (dst / ".complete").write_text("{}")


_models: dict[Path, object] = {}


def fresh_logprobs(model_dir: Path, prompt: list[int], action: list[int]) -> list[float]:
    """Log-probs of `action` after `prompt` under the model in `model_dir`, at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _models.get(model_dir)
    if model is None:
        model = _models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + action])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # temperature 1
    return logits.log_softmax(-1).gather(-1, torch.tensor(action)[:, None]).squeeze(-1).tolist()
