"""The learning-rate schedule (learner.train.lr_factor) against hand-computed values, and the
optimiser's lr following it step by step."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gagpo.learner.config import LearnerConfig
from gagpo.learner.train import lr_factor, make_optimizer


def _cfg(**kw) -> LearnerConfig:
    return LearnerConfig(store="/tmp/unused", lr=1e-3, **kw)


def test_constant_is_one_after_the_warmup():
    cfg = _cfg(warmup_steps=3)
    assert [lr_factor(s, 10, cfg) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("cosine", 0, 1.0),
        ("cosine", 10, 0.1 + 0.9 * 0.5),  # half-way: cos(π/2) = 0
        ("cosine", 5, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),
        ("cosine", 20, 0.1),  # the last of 21 steps
        ("cosine", 25, 0.1),  # past the end (a resumed run given more updates): stays at the floor
        ("linear", 0, 1.0),
        ("linear", 5, 0.1 + 0.9 * 0.75),
        ("linear", 20, 0.1),
    ],
)
def test_decay_reaches_lr_final_at_the_last_step(schedule, step, expected):
    assert lr_factor(step, 21, _cfg(lr_schedule=schedule)) == pytest.approx(expected)


def test_decay_starts_after_the_warmup():
    cfg = _cfg(lr_schedule="linear", warmup_steps=4, lr_final=0.0)
    # steps 0-3 warm up; the decay runs over steps 4..14 (10 intervals) down to 0
    assert lr_factor(3, 15, cfg) == pytest.approx(0.8)
    assert lr_factor(4, 15, cfg) == pytest.approx(1.0)
    assert lr_factor(9, 15, cfg) == pytest.approx(0.5)
    assert lr_factor(14, 15, cfg) == pytest.approx(0.0)


def test_optimiser_follows_the_schedule_over_updates_times_mini_batches():
    cfg = _cfg(lr_schedule="cosine", updates=5, mini_batches=2, lr_final=0.2)
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = make_optimizer(model, cfg)
    seen = []
    for _ in range(10):  # 5 updates × 2 optimiser steps
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(1e-3)
    assert seen[-1] == pytest.approx(2e-4)
    assert all(a > b for a, b in itertools.pairwise(seen))
    # a restored scheduler continues where it stopped (checkpoints save its state_dict)
    _, again = make_optimizer(model, cfg)
    again.load_state_dict(scheduler.state_dict())
    assert again.get_last_lr()[0] == pytest.approx(scheduler.get_last_lr()[0])


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule"):
        _cfg(lr_schedule="step")
