"""The learner on an object store (moto S3 on loopback): everything goes through fsspec."""

from __future__ import annotations

import pytest

from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.learner.train import train
from gagpo.schemas.layout import COMPLETE
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_model_dir, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_learner_on_s3_publishes_checkpoints_and_resumes(s3_endpoint, tmp_path):
    url = f"s3://gagpo/{tmp_path.name}"
    store = Store(url, skip_instance_cache=True)
    write_shards(store, 3)
    cfg = dict(
        store=url,
        policy=str(tiny_model_dir()),
        batch_groups=2,
        idle_timeout_s=0.5,
        poll_interval_s=0.05,
        keep_versions=2,
    )
    assert train(LearnerConfig(**cfg, updates=2)).updates == 2
    assert train(LearnerConfig(**cfg, updates=3, resume=True)).updates == 3
    store = Store(url, skip_instance_cache=True)
    assert store.policies.latest() == 3
    assert store.fs.exists(f"{store.policies.dir(3)}/{COMPLETE}") and not store.fs.exists(
        store.policies.dir(1)
    )
    assert len(Ledger.load(store).rows) == 6 and read_metrics(store)["update"].to_list() == [
        1,
        2,
        3,
    ]
    # what an actor on another machine does
    local = store.policies.fetch(3, str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(local, local_files_only=True, use_safetensors=True)
