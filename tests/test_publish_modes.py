"""Published folders are readable by group and others (0644 files, 0755 folders), whatever
the publishing process's umask or the modes of the files they were copied from: actors on
a shared store may run as other users."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from gagpo.learner.model import load_model
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_model_dir
from tests.helpers.publication import publish

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def strict_umask():
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(folder: Path) -> set[tuple[str, int]]:
    out = {("dir", stat.S_IMODE(folder.stat().st_mode))}
    for path in folder.rglob("*"):
        kind = "dir" if path.is_dir() else "file"
        out.add((kind, stat.S_IMODE(path.stat().st_mode)))
    return out


def test_published_versions_and_the_base_policy_are_world_readable(tmp_path, strict_umask):
    # The source folder as a private cache would hold it: 0600 files in a 0700 folder.
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir(), base)
    for path in base.iterdir():
        path.chmod(0o600)
    base.chmod(0o700)
    store = Store(str(tmp_path / "store"))
    store.policies.publish_base(str(base))
    assert _modes(Path(store.policies.dir(0))) == {("dir", 0o755), ("file", 0o644)}

    model = load_model(base, torch.device("cpu"))
    folder = Path(publish(store, model, base, 1))
    assert (folder / ".complete").is_file() and (folder / "model.safetensors").is_file()
    assert _modes(folder) == {("dir", 0o755), ("file", 0o644)}
