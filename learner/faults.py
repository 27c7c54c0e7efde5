"""The learner's crash-test hook points (storage/faults.py): `GAGPO_LEARNER_HOLD` (or
`GAGPO_HOLD`) = "<phase>:<update>:<path>" holds the learner on reaching `phase`
(backward, checkpoint, publish, commit-<folder>) during update `update`."""

from __future__ import annotations

from gagpo.storage.faults import fault_point, set_ordinal

__all__ = ["fault_point", "set_update"]


def set_update(update: int) -> None:
    set_ordinal(update)
