"""Shared fixtures. TextWorld and friends write to $HOME and /tmp: point both at scratch."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SCRATCH = Path(tempfile.mkdtemp(prefix="gagpo-tests-"))
(_SCRATCH / "home").mkdir(exist_ok=True)
(_SCRATCH / "tmp").mkdir(exist_ok=True)
os.environ["HOME"] = str(_SCRATCH / "home")
os.environ["TMPDIR"] = str(_SCRATCH / "tmp")
tempfile.tempdir = None  # re-read TMPDIR
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Share model caches across the test session (converting the GGUF model takes a while).
os.environ.setdefault("GAGPO_CACHE", str(Path.home() / ".cache" / "gagpo"))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """An empty local store root."""
    root = tmp_path / "store"
    root.mkdir()
    return root
