"""One staleness (schemas.policy.staleness, docs/design.md §6): learner version when the
batch is formed − the behaviour version. Every figure the learner logs, and the actors'
throttle, measure it so: data of the learner's own version has staleness 0."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import polars as pl

from gagpo.actors.throttle import room
from gagpo.learner.feed import Batch, GroupRef
from gagpo.learner.train import histograms, metrics_row
from gagpo.schemas.policy import staleness


def group(version: int, i: int = 0) -> GroupRef:
    return GroupRef("run", f"s{i}", f"g{i}", version, 1, committed_at=0.0)


def test_staleness_is_learner_version_minus_behaviour_version():
    assert staleness(5, 3) == 2 and staleness(4, 4) == 0
    assert staleness(5, np.array([5, 4, 1])).tolist() == [0, 1, 4]


def test_logged_figures_measure_at_the_version_the_batch_was_formed():
    """Update 3 trains a batch formed at version 2 and publishes version 3: groups of
    versions 2, 1, 0 have staleness 0, 1, 2 in the metrics row and in the histogram."""
    groups = [group(v, i) for i, v in enumerate([2, 1, 0])]
    batch = Batch(pl.DataFrame({"x": [1, 2, 3]}), groups, stale=[group(0, 9)])
    feed = SimpleNamespace(stats=SimpleNamespace(groups_stale=1))
    row = metrics_row(3, 3, batch, {"tokens": 10}, feed, t_wait=0.0, t0=1.0, t1=2.0)
    assert (row["version"], row["staleness_mean"], row["staleness_max"]) == (3, 1.0, 2)
    counts, edges = histograms({}, batch, 2, max_staleness=2)["staleness"]
    assert counts.tolist() == [1, 1, 1, 1] and edges == [0, 1, 2, 3]  # last bin: dropped


def test_throttle_lets_the_learners_own_version_through_at_staleness_zero():
    """With max_staleness 0 a group of the learner's version is trained (room for one
    batch), one of the version before is not."""
    assert room(0, learner_version=2, policy_version=2, batch_groups=4, max_staleness=0) == 4
    assert room(0, learner_version=2, policy_version=1, batch_groups=4, max_staleness=0) == 0
