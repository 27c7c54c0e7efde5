"""Warm start from demonstrations: the expert demonstrator, the supervised loss, demo shards
that are ordinary shards, SFT that lowers their NLL, and a warm-started policy that beats
the untrained one (docs/warmstart.md)."""

from __future__ import annotations

import json
import math
import random
from functools import partial

import pyarrow.parquet as pq
import pytest
import torch

from gagpo.actors.demos import DEMONSTRATION, META_SOURCE, Expert
from gagpo.actors.rollout import rollout_group
from gagpo.envs import make_env
from gagpo.learner.sft import sft_loss
from gagpo.schemas import columns as C
from gagpo.storage.store import Store

# --- the supervised objective --------------------------------------------------------------


def test_sft_loss_is_token_mean_nll_by_hand():
    # Two actions: 2 tokens with p = 1/2, 1/4; 1 token with p = 1/8 (left slot is padding).
    logp = torch.tensor([[math.log(0.5), math.log(0.25)], [0.0, math.log(0.125)]])
    mask = torch.tensor([[True, True], [False, True]])
    loss, m = sft_loss(logp.clone().requires_grad_(True), mask)
    expected = (math.log(2) + math.log(4) + math.log(8)) / 3  # per token, not per action
    assert loss.item() == pytest.approx(expected)
    assert m["tokens"] == 3 and m["actions"] == 2 and m["masked_actions"] == 0


def test_sft_loss_masks_empty_and_non_finite_actions():
    logp = torch.tensor([[-1.0, -3.0], [0.0, 0.0], [float("-inf"), -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, False], [True, True]])
    loss, m = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(2.0)  # only the first action counts
    assert m["masked_actions"] == 2
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])


# --- the demonstrator ------------------------------------------------------------------------


class _WordTokenizer:
    """Stands in for a policy's tokenizer: one id per word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}


class _Tokenizing:
    tokenizer = _WordTokenizer()
    eos_ids = (99,)
    version = 0

    def encode_chat(self, messages):
        return [1, 2, 3]


@pytest.mark.parametrize("env_name", ["sokoban", "household"])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_expert_wins_and_replans_after_noise(env_name, noise):
    factory = partial(make_env, env_name, 40)
    rng = random.Random(0)
    wins = rollouts = random_turns = 0
    for seed in range(12):
        policy = _Tokenizing()
        result = rollout_group(
            factory,
            policy,
            task_seed=seed,
            group_id=f"g{seed}",
            run_id="r",
            shard_id="s",
            group_size=2,
            history_window=1,
            sampling_seed=0,
            demonstrator=Expert(policy, noise, rng),
        )
        wins += result.successes
        rollouts += result.rollouts
        ids = result.columns[C.ACTION_IDS]
        assert all(a[-1] == 99 for a in ids)  # every reply ends with end-of-turn
        logprobs = result.columns[C.BEHAVIOR_LOGPROBS]
        assert all(lp == [0.0] * len(a) for a, lp in zip(ids, logprobs, strict=True))
        random_turns += sum(not v for v in result.columns[C.ACTION_VALID])
    assert random_turns == 0  # random commands are drawn from the admissible ones
    if noise == 0:
        assert wins == rollouts
    else:  # replanning recovers from most detours
        assert wins >= 0.8 * rollouts


def test_noisy_expert_never_plays_a_template_and_searches_its_own_query():
    """WebShop's search page lists only `search[<your query>]`, a template: a noisy turn
    there follows the plan (the expert's real query); elsewhere noise plays commands."""
    from gagpo.actors.demos import playable

    assert playable(("search[<your query>]",)) == []
    assert playable(("click[back to search]", "search[<q>]")) == ["click[back to search]"]
    assert playable(None) == []
    env, rng = make_env("webshop", 15), random.Random(1)
    noisy = 0
    for seed in range(20):
        expert = Expert(_Tokenizing(), noise=1.0, rng=rng)  # one per group, as actors make
        admissible = env.reset(seed).admissible
        plan = env.expert_plan()
        assert admissible == ("search[<your query>]",)
        assert expert.choose(env, admissible) == plan[0]  # the real query, not the template
        step = env.step(plan[0])
        for _ in range(5):  # noise 1: every later turn plays a listed command
            if step.done:
                break
            command = expert.choose(env, step.admissible)
            assert command in playable(step.admissible) or command in plan
            noisy += command in playable(step.admissible)
            step = env.step(command)
    assert noisy >= 50


# --- demonstrations → SFT → a better policy -------------------------------------------------


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One small warm start on sokoban, in a private cache; (config, policy folder, log)."""
    import os

    from gagpo.workflows.warmstart import WarmstartConfig, warmstart

    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("GAGPO_CACHE")
    os.environ["GAGPO_CACHE"] = str(cache)
    try:
        # 5x5 grids with one box: short, fast rollouts that valid moves can solve
        cfg = WarmstartConfig(
            env="sokoban",
            env_options={"sizes": [5, 5], "max_boxes": 1},
            max_turns=10,
            history_window=0,
            demos=256,
            batch_groups=16,
            lr=5e-3,
        )
        log: list[str] = []
        folder = warmstart(cfg, echo=log.append)
        again: list[str] = []
        assert warmstart(cfg, echo=again.append) == folder
        yield cfg, folder, log, again
    finally:
        if old is None:
            os.environ.pop("GAGPO_CACHE", None)
        else:
            os.environ["GAGPO_CACHE"] = old


def test_demonstrations_are_ordinary_shards_with_the_policys_prompts(warm):
    from gagpo.actors.policies.presets import load_policy
    from gagpo.actors.prompts import build_messages

    cfg, folder, _, _ = warm
    store = Store(str(folder.parent / "store"))
    refs = store.list_shards()
    assert refs
    table = store.read_shard(refs[0])  # validates: schema, whole groups, lengths
    assert table.schema.metadata[META_SOURCE] == DEMONSTRATION
    assert pq.read_metadata(refs[0].path).metadata[C.META_GROUP_SIZE] == b"1"
    # The first prompt of a rollout is exactly what an RL actor would present.
    policy = load_policy("tiny")
    env = make_env("sokoban", cfg.max_turns, **cfg.env_options)
    row = table.slice(0, 1).to_pylist()[0]
    first = env.reset(int(row[C.TASK_ID].rsplit("-", 1)[1]))
    messages = build_messages(env.instructions, [], first.observation, first.admissible, 0)
    assert row[C.STEP] == 0
    assert row[C.PROMPT_IDS] == policy.encode_chat(messages)
    assert row[C.ACTION_IDS][-1] == policy.eos_ids[0]


def test_sft_lowers_nll_and_the_result_is_cached(warm):
    _, folder, log, again = warm
    info = json.loads((folder.parent / "warmstart.json").read_text())
    assert info["nll_last"] < 0.5 * info["nll_first"]
    assert info["key"] == folder.parent.name  # the cache key, not the temporary build name
    assert any("supervised update" in line for line in log)
    progress = [line for line in log if line.startswith("warm start: SFT update ")]
    assert [line.split()[4] for line in progress] == [f"{u}/16" for u in range(2, 17, 2)]
    assert all("loss" in line for line in progress)
    assert again == [f"warm start: cached at {folder.parent}"]
    assert not list(folder.parent.parent.glob(".*tmp*"))  # built under a temporary name


def test_warm_started_policy_beats_the_untrained_one(warm):
    from gagpo.workflows.warmstart import evaluate

    cfg, folder, _, _ = warm
    untrained = evaluate("tiny", cfg, groups=32)
    warmed = evaluate(str(folder), cfg, groups=32)  # `--policy <folder>`: weights and tokenizer
    assert warmed["valid_rate"] > untrained["valid_rate"] + 0.5
    assert warmed["success_rate"] > untrained["success_rate"]


def test_cache_key_follows_the_environments_revision(monkeypatch):
    """A built-in environment whose observations changed (its `revision`) gets new warm-start
    cache keys; environments without one keep theirs."""
    from gagpo.envs.household import Household
    from gagpo.envs.sokoban import Sokoban
    from gagpo.workflows.warmstart import WarmstartConfig, cache_key

    household, sokoban = WarmstartConfig(env="household"), WarmstartConfig(env="sokoban")
    keys = cache_key(household), cache_key(sokoban)
    monkeypatch.setattr(Household, "revision", Household.revision + 1, raising=False)
    monkeypatch.setattr(Sokoban, "revision", 0, raising=False)
    assert cache_key(household) != keys[0]
    assert cache_key(sokoban) == keys[1]
