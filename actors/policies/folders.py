"""Hugging Face model folders: what a loadable one holds, and quiet loading.

Shared by the preset resolver (presets.py) and both policy backends (hf.py,
vllm_backend.py); it imports none of them, so they never import each other for it.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import missing_model_error


def check_model_dir(model_dir: Path) -> None:
    """A loadable folder has a config, safetensors weights and a tokenizer; never pickles."""
    if not model_dir.is_dir():
        raise missing_model_error(str(model_dir))
    if not (model_dir / "config.json").is_file():
        raise GagpoError(
            f"model folder '{model_dir}' has no config.json; accepted: a Hugging Face model folder"
        )
    if not any(model_dir.glob("*.safetensors")):
        raise GagpoError(
            f"model folder '{model_dir}' has no .safetensors weights; accepted: safetensors "
            "weights (pickled .bin checkpoints are never loaded)"
        )
    if not any(
        (model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise GagpoError(
            f"model folder '{model_dir}' has no tokenizer; accepted: a folder saved with its tokenizer"
        )


@contextmanager
def quiet_transformers():
    """No progress bars while converting or loading (actors reload on every version)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_chat_tokenizer(model_dir: Path):
    """The folder's tokenizer; it must define a chat template (every prompt is a chat)."""
    from transformers import AutoTokenizer

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise GagpoError(
            f"model folder '{model_dir}' has no chat template; accepted: a folder whose "
            "tokenizer defines chat_template"
        )
    return tokenizer


def chat_prompt_ids(tokenizer, messages: list[dict], tools=None) -> list[int]:
    """Chat template + generation prompt as token ids, whole: the same ids whichever
    backend samples from them. Nothing is cut: a prompt past the context is the rollout
    loop's to answer (whole turns dropped, or OpenAI's context_length_exceeded)."""
    from gagpo.actors.policies.prompt_ids import render, text_ids

    return text_ids(tokenizer, render(tokenizer, messages, tools, generation=True))
