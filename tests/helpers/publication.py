"""Publishing a model as a policy version the way the learner does (learner/train.py
`Trainer.take_version` and `release_version`): full weights, merged LoRA ones included,
through a `Publisher` (its folder written, then LATEST moved and the versions pruned);
a LoRA adapter (`publish = "adapter"`) written by `write_version`, then `point_latest`."""

from __future__ import annotations

from pathlib import Path

from gagpo.learner.publish import Publisher, VersionCopy, point_latest, take_weights, write_version
from gagpo.storage.store import Store


def publish(
    store: Store,
    model,
    base_dir: Path,
    version: int,
    *,
    keep: int = 3,
    keep_every: int = 0,
    lora=None,
    dtype=None,
    lineage: dict | None = None,
) -> str:
    """Publish `model` as `version` (weights in `dtype`, None: the model's own) on the
    caller's thread; return the version's folder."""
    if lora is not None and lora.publish == "adapter":
        write_version(store, model, base_dir, version, lora, lineage=lineage)
        point_latest(store, version, keep, keep_every)
    else:
        publisher = Publisher(store, model, base_dir, keep, keep_every, asynchronous=False)
        weights = take_weights(model, dtype=dtype, copy=False)
        publisher.publish(VersionCopy(version, version, weights, lineage, dtype))
        publisher.close()
    return store.policies.dir(version)
