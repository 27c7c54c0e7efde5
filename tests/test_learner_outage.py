"""The learner rides out an object-store outage shorter than the retry bound in every
phase of an update (issue 21, item 2): it exited 2 on `learner/histograms.zarr/…` and on
`policy/v0/.complete`, paths that did not go through the retry. Here the endpoint goes
away at every phase of two updates (listing, backward, ledger, metrics, histograms,
checkpoint, publication) and comes back 1 s later; the learner finishes, one lineage."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from gagpo.learner.checkpoint import check_lineage
from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_model_dir, write_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OUTAGE_S = 1.0


class Outages:
    """Stops the endpoint at a hooked phase (twice per phase at most) and restarts it
    OUTAGE_S later. A phase's first outage always happens: reached while the endpoint is
    down (the publishing thread runs beside the update), it waits for the endpoint to come
    back, then stops it again. A second one is skipped then, or a moment after a return."""

    def __init__(self, emu) -> None:
        self.emu, self.down, self.phases = emu, threading.Lock(), []
        self.back_at = -1e9

    def __call__(self, phase: str) -> None:
        first = phase not in self.phases
        if self.phases.count(phase) >= 2:
            return
        if not first and time.monotonic() - self.back_at < 0.1:
            return
        if not self.down.acquire(blocking=first):
            return
        self.phases.append(phase)
        self.emu.stop()

        def back() -> None:
            self.emu.start()
            self.back_at = time.monotonic()
            self.down.release()

        threading.Timer(OUTAGE_S, back).start()


@pytest.mark.slow
def test_learner_survives_an_outage_in_every_phase(emulator, tmp_path, monkeypatch, caplog):
    import gagpo.learner.faults as learner_faults
    import gagpo.learner.publish as publish
    import gagpo.storage.store as store_module
    from gagpo.learner.feed import Feed
    from gagpo.learner.metrics import MetricsLog
    from gagpo.learner.train import train
    from gagpo.storage.registry import PolicyRegistry

    url = f"s3://outage/{tmp_path.name}"
    store = Store(url)
    write_shards(store, 2)
    outage = Outages(emulator)

    def at(phase: str) -> None:
        if not phase.startswith("commit-shards"):
            outage(phase)

    monkeypatch.setattr(store_module, "fault_point", at)
    monkeypatch.setattr(learner_faults, "fault_point", at)
    monkeypatch.setattr(publish, "fault_point", at)
    for cls, name, phase in [
        (MetricsLog, "_write_histograms", "histograms"),
        (Feed, "poll", "listing"),
        (PolicyRegistry, "set_latest", "latest"),
    ]:
        original = getattr(cls, name)

        def hooked(self, *args, _original=original, _phase=phase, **kwargs):
            outage(_phase)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, hooked)
    monkeypatch.setenv("GAGPO_STORE_RETRY_S", "60")
    cfg = LearnerConfig(
        store=url,
        policy=str(tiny_model_dir()),
        batch_groups=2,
        updates=2,
        idle_timeout_s=30,
        poll_interval_s=0.05,
    )
    with caplog.at_level(logging.WARNING, logger="gagpo.store"):
        summary = train(cfg)
    assert summary.updates == 2 and summary.version == 2
    fired = set(outage.phases)
    assert {
        "listing",
        "backward",
        "commit-learner",
        "histograms",
        "checkpoint",
        "publish",
        "latest",
    } <= fired, fired
    retried = " ".join(r.getMessage() for r in caplog.records)
    assert "histograms.zarr" in retried and ".complete" in retried and "LATEST" in retried
    with outage.down:  # the endpoint is up
        store = Store(url)
        assert store.policies.latest() == 2 and check_lineage(store) == []
        assert len(Ledger.load(store).rows) == 4
        assert read_metrics(store)["update"].to_list() == [1, 2]


def test_a_bucket_that_vanished_is_one_line(emulator, tmp_path):
    """After the endpoint came back without its bucket, the actor died with a traceback
    (FileNotFoundError: The specified bucket does not exist)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=emulator.endpoint)
    s3.create_bucket(Bucket="vanishing")
    store = Store(f"s3://vanishing/{tmp_path.name}")
    store.policies.set_latest(0)
    for item in s3.list_objects_v2(Bucket="vanishing").get("Contents", []):
        s3.delete_object(Bucket="vanishing", Key=item["Key"])
    s3.delete_bucket(Bucket="vanishing")
    from tests.helpers.steps import make_steps

    with pytest.raises(GagpoError) as info:
        store.write_shard(make_steps(shard_id="a"), group_size=3)
    message = str(info.value)
    assert "\n" not in message and "bucket 'vanishing' does not exist" in message
