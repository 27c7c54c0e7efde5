"""Shared fixtures. TextWorld and friends write to $HOME and /tmp: point both at scratch,
removed when the session ends (a full run leaves 3 GB there; GAGPO_KEEP_TEST_SCRATCH=1
keeps it for a look)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.s3 import CREDENTIALS, Emulator, start_s3

_SCRATCH = Path(tempfile.mkdtemp(prefix="gagpo-tests-"))
if not os.environ.get("GAGPO_KEEP_TEST_SCRATCH"):
    atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
(_SCRATCH / "home").mkdir(exist_ok=True)
(_SCRATCH / "tmp").mkdir(exist_ok=True)
os.environ["HOME"] = str(_SCRATCH / "home")
os.environ["TMPDIR"] = str(_SCRATCH / "tmp")
tempfile.tempdir = None  # re-read TMPDIR
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Share model caches across the test session (converting the GGUF model takes a while).
os.environ.setdefault("GAGPO_CACHE", str(Path.home() / ".cache" / "gagpo"))


# Tests that must not run beside one another when the suite runs in several processes
# (`make test`: pytest -n 2 --dist loadgroup): each group runs in one process, in turn.
# llm: SmolLM2 runs in several processes at once (5-8 GB each); ray: a local Ray instance
# each, with its own object store in /dev/shm.
ONE_AT_A_TIME = {
    "llm": ("test_llm_demo.py", "test_gpu_learn.py", "test_policies.py"),
    "ray": ("test_ray_run.py", "test_ray_nodes.py", "test_recompute_parallel.py"),
}


def pytest_collection_modifyitems(items):
    for item in items:
        for group, files in ONE_AT_A_TIME.items():
            if item.path.name in files:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """An empty local store root."""
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """The learner tests' models are tiny: one thread is faster than two contended ones.
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback with a bucket `gagpo`, and credentials in the
    environment for s3fs."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    server, endpoint = start_s3("gagpo")
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def emulator(monkeypatch):
    """An S3 emulator with a bucket `outage` that a test may stop and start again."""
    import boto3
    import s3fs

    emu = Emulator()
    emu.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", emu.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would hide ours
    boto3.client("s3", endpoint_url=emu.endpoint).create_bucket(Bucket="outage")
    s3fs.S3FileSystem.clear_instance_cache()  # instances hold their endpoint
    yield emu
    s3fs.S3FileSystem.clear_instance_cache()
    emu.stop()
