"""The learner's ratio and behaviour-weight histograms record the terms the loss used
(learner/loss.py), at every ratio level, with bypass on and off; and an update reads its
diagnostics from the device once, however many micro-batches it has."""

from __future__ import annotations

import math
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

from gagpo.learner.batching import plan
from gagpo.learner.config import LearnerConfig, LossSettings
from gagpo.learner.dist import Dist
from gagpo.learner.feed import BATCH_COLUMNS
from gagpo.learner.metrics import Histogram
from gagpo.learner.model import action_logprobs, load_model
from gagpo.learner.train import make_optimizer
from gagpo.learner.update import HISTOGRAMS, run_update
from gagpo.schemas import columns as C
from tests.helpers.learner import shard_table, tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = Dist(0, 1, torch.device("cpu"))
BOUND = 1.0  # log_ratio_bound: small enough that some of these ratios reach it
CAP = 2.0


def batch(groups: int = 3) -> pa.Table:
    table = shard_table("h0", groups=groups)
    table = table.append_column(C.ADVANTAGE, pa.array(np.linspace(-1, 1, table.num_rows)))
    return table.select(list(BATCH_COLUMNS))


def config(**loss) -> LearnerConfig:
    return LearnerConfig(
        store="unused",
        policy=str(tiny_model_dir()),
        batch_groups=3,
        lr=1e-6,
        loss=LossSettings(log_ratio_bound=BOUND, behavior_cap=CAP, **loss),
    )


def expected(model, table: pa.Table, cfg: LearnerConfig) -> dict[str, np.ndarray]:
    """The histograms written out by hand. With one mini-batch π_prox is π_θ before the step
    (ratio 1, weight π_θ/π_behav); bypass sets π_prox = π_behav (ratio π_θ/π_behav, weight 1)."""
    loss = cfg.loss
    ratios, weights = [], []
    for mb in plan(
        table,
        version=0,
        pad_id=0,
        max_positions=1 << 20,
        budget=cfg.micro_batch_tokens,
        token_mean=False,
    ):
        with torch.no_grad():
            logp, _ = action_logprobs(model, mb, cfg.temperature)
        mask = mb.action_mask
        diff = torch.where(mask, logp - mb.logp_behav, torch.zeros_like(logp)).double()
        n = mask.sum(1)
        mean = diff.sum(1) / n
        if loss.ratio_level == "token":
            off = diff[mask]
        elif loss.ratio_level == "sequence":
            off = diff.sum(1)
        else:
            off = mean
        if loss.bypass:
            ratios.append(torch.exp(off.clamp(-BOUND, BOUND)))
            weights.append(torch.ones_like(mean))
        else:
            ratios.append(torch.ones_like(off))
            weights.append(torch.exp(mean.clamp(-BOUND, min(BOUND, math.log(CAP)))))
    return {
        "ratio": HISTOGRAMS["ratio"].counts(torch.cat(ratios)).numpy(),
        "behavior_weight": HISTOGRAMS["behavior_weight"].counts(torch.cat(weights)).numpy(),
    }


@pytest.mark.parametrize("bypass", [False, True])
@pytest.mark.parametrize("ratio_level", ["action", "token", "sequence"])
def test_ratio_and_weight_histograms_are_what_the_loss_used(ratio_level, bypass):
    torch.manual_seed(0)
    model = load_model(tiny_model_dir(), CPU.device).train()
    cfg = config(bypass=bypass, ratio_level=ratio_level)
    table = batch()
    want = expected(model, table, cfg)
    _, hists = run_update(
        model, *make_optimizer(model, cfg), table, version=0, cfg=cfg, d=CPU, pad_id=0
    )
    actions = table.num_rows
    tokens = sum(len(ids) for ids in table[C.ACTION_IDS].to_pylist())
    assert hists["ratio"].sum() == (tokens if ratio_level == "token" else actions)
    assert hists["behavior_weight"].sum() == actions
    # The case that matters is not degenerate: π_θ/π_behav spreads over several bins.
    spread = want["ratio"] if bypass else want["behavior_weight"]
    assert (spread > 0).sum() >= 3
    np.testing.assert_array_equal(hists["ratio"], want["ratio"])
    np.testing.assert_array_equal(hists["behavior_weight"], want["behavior_weight"])


def test_histogram_counts_match_histc_and_honour_the_mask():
    torch.manual_seed(1)
    h = Histogram(0.0, 2.0)
    values = torch.cat([torch.rand(500) * 3 - 0.5, torch.tensor([0.0, 2.0, 1.0, 0.05])])
    want = torch.histc(values.double().clamp(0, 2), bins=h.bins, min=0.0, max=2.0).long()
    assert torch.equal(h.counts(values), want)
    mask = torch.rand(values.shape) > 0.5
    assert torch.equal(h.counts(values, mask), h.counts(values[mask]))
    assert int(h.counts(torch.tensor([math.nan, math.inf, 1.0])).sum()) == 2  # nan is not counted


# --- device syncs: gathered once per update -------------------------------------------
_LEARNER_FILES = ("learner/train.py", "learner/loss.py", "learner/sft.py", "learner/metrics.py")
_READS = ("__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy")


def reads_per_update(monkeypatch, micro_batch_tokens: int) -> tuple[int, int]:
    """(tensor reads made by the learner's own update code, micro-batches)."""
    torch.manual_seed(0)
    model = load_model(tiny_model_dir(), CPU.device).train()
    cfg = config().model_copy(update={"micro_batch_tokens": micro_batch_tokens})
    table = batch(groups=4)
    micro_batches = len(
        plan(
            table,
            version=0,
            pad_id=0,
            max_positions=1 << 20,
            budget=micro_batch_tokens,
            token_mean=False,
        )
    )
    optimizer, scheduler = make_optimizer(model, cfg)
    count = [0]
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if caller.endswith(_LEARNER_FILES):
                count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run_update(model, optimizer, scheduler, table, version=0, cfg=cfg, d=CPU, pad_id=0)
    monkeypatch.undo()
    return count[0], micro_batches


def test_an_update_reads_its_diagnostics_once_whatever_the_micro_batches(monkeypatch):
    one, n_one = reads_per_update(monkeypatch, micro_batch_tokens=1 << 16)
    many, n_many = reads_per_update(monkeypatch, micro_batch_tokens=64)
    assert n_one == 1 and n_many >= 4
    assert many == one  # not one per number and micro-batch
    assert one <= 12
