"""One recorded learner update, and the comparison of two: the equality tests of turn
merging, the prefix trie and the vocabulary chunks (tests/test_learner_merge.py,
test_learner_trie.py, test_learner_vocab_chunks.py) hold two encodings of one batch to
the same loss, per-action ratios, behaviour weights and gradients (fp32, <= TOL)."""

from __future__ import annotations

import numpy as np
import torch

from gagpo.learner import update as update_module
from gagpo.learner.config import LearnerConfig, LossSettings
from gagpo.learner.dist import Dist
from gagpo.learner.update import run_update
from tests.helpers.learner import tiny_model_dir

CPU = Dist(0, 1, torch.device("cpu"))
TOL = 1e-5


class Recorder:
    """An SGD 'optimiser' that keeps each step's gradients (by parameter name) and moves
    the weights, so that later slices see a π_θ that differs from π_prox."""

    def __init__(self, model, lr: float = 0.1):
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.lr, self.grads = lr, []

    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named})
        with torch.no_grad():
            for _, p in self.named:
                p -= self.lr * p.grad

    def zero_grad(self, set_to_none=True):
        for _, p in self.named:
            p.grad = None


class NoSchedule:
    def step(self):
        pass


def one_update(
    model,
    ref,
    table,
    on: bool,
    monkeypatch,
    budget: int = 256,
    terms: bool = False,
    setting: str = "merge_turns",
) -> dict:
    """`run_update` (2 mini-batches of `budget`-token micro-batches; with `terms`, the KL
    and entropy terms too) with every action's ratio and behaviour weight recorded, keyed
    by its advantage (all distinct). `on` is the value of the learner `setting` compared
    (turn merging, the prefix trie).

    The KL and entropy terms are token means per micro-batch, weighted by the micro-batch's
    share of actions (learner/loss.py, learner/train.py): they depend on how the actions
    fall into micro-batches, for per-step rows too. So they are compared where both sides
    form one micro-batch per slice; the policy-gradient term does not depend on it."""
    seen = []
    real_loss = update_module.gagpo_loss

    def recording_loss(logp, logp_prox, logp_behav, mask, advantages, cfg, **kw):
        out, m = real_loss(logp, logp_prox, logp_behav, mask, advantages, cfg, **kw)
        seen.append((advantages.clone(), m["ratio"].clone(), m["behavior_weight"].clone()))
        return out, m

    monkeypatch.setattr(update_module, "gagpo_loss", recording_loss)
    cfg = LearnerConfig(
        store="unused",
        policy=str(tiny_model_dir()),
        batch_groups=2,
        mini_batches=2,
        micro_batch_tokens=budget,
        **{setting: on},
        loss=LossSettings(kl_coef=0.1 if terms else 0.0, entropy_coef=0.01 if terms else 0.0),
    )
    optimizer = Recorder(model)
    stats, hist = run_update(
        model, optimizer, NoSchedule(), table, version=0, cfg=cfg, d=CPU, pad_id=0, ref_model=ref
    )
    adv, ratio, weight = (torch.cat([s[i] for s in seen]).numpy() for i in range(3))
    order = np.argsort(adv)
    return {
        "stats": stats,
        "hist": hist,
        "ratio": ratio[order],
        "weight": weight[order],
        "grads": optimizer.grads,
    }


def assert_same_update(a: dict, b: dict, fewer_tokens: bool = True) -> None:
    for key in ("loss", "pg_loss", "kl_ref", "entropy", "approx_kl", "behavior_weight_mean"):
        assert abs(a["stats"][key] - b["stats"][key]) <= TOL, key
    assert a["stats"]["actions"] - a["stats"]["context_skipped"] == b["stats"]["actions"]
    assert a["stats"]["action_tokens"] == b["stats"]["action_tokens"]
    assert np.abs(a["ratio"] - b["ratio"]).max() <= TOL
    assert np.abs(a["weight"] - b["weight"]).max() <= TOL
    assert np.abs(a["ratio"] - 1).max() > 5e-5  # the second slice's ratios moved
    assert len(a["grads"]) == len(b["grads"]) == 2
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        for name in ga:
            assert (ga[name] - gb[name]).abs().max() <= TOL, name
        assert any(g.abs().max() > 1e-4 for g in ga.values())
    if fewer_tokens:
        assert a["stats"]["tokens"] * 4 < b["stats"]["tokens"]  # merged encodes far fewer


def assert_fsdp_runs_agree(tmp_path, flags: tuple[str, str], shard_steps) -> None:
    """Two CPU ranks under FSDP, once with each learner flag of `flags`, on stores of the
    same two shards (`shard_steps(i)` for shard i): 2 updates at lr 1 with adam_eps 1, so
    AdamW's first step is about lr·g and a gradient difference shows in the weights (a plain
    AdamW step would only keep signs). The published v2 parameters moved from the base and
    agree to TOL."""
    from gagpo.storage.store import Store
    from tests.helpers.learner import parameters, run_torchrun, tiny_learner_args

    published = {}
    for flag in flags:
        store = Store(str(tmp_path / flag))
        for i in range(2):
            store.write_shard(shard_steps(i), group_size=3)
        args = tiny_learner_args(
            tmp_path / flag,
            flag,
            "--parallel",
            "fsdp",
            updates=2,
            batch_groups=2,
            lr=1.0,
            adam_eps=1.0,
            micro_batch_tokens=256,
        )
        run = run_torchrun(*args)
        assert run.returncode == 0, run.stderr[-8000:]
        published[flag] = parameters(store.policies.dir(2))
    base = parameters(tiny_model_dir())
    a, b = published.values()
    assert a.keys() == b.keys()
    assert max(np.abs(a[k] - base[k]).max() for k in a) > 1e-2  # the weights moved
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=TOL, rtol=0, err_msg=name)
