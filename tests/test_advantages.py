"""The advantage stage against the brute-force per-group reference, case by case."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from gagpo.pipeline import compute_advantages, diagnostics, parse_estimator_config
from gagpo.pipeline.config import ESTIMATOR_NAMES, NORMS
from gagpo.pipeline.reference import reference_advantages
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.advantages import assert_matches_reference, rollout, run, steps_frame


def all_configs():
    """Every estimator with each normalisation and non-default weights."""
    configs = []
    for name in ESTIMATOR_NAMES:
        for norm in NORMS:
            configs.append(parse_estimator_config({"estimator": name, "norm": norm}))
    configs += [
        parse_estimator_config(
            {"estimator": "gagpo", "gamma": 0.9, "lam": 0.5, "omega_episode": 0.7}
        ),
        parse_estimator_config({"estimator": "gagpo", "gamma": 1.0, "lam": 1.0}),
        parse_estimator_config({"estimator": "gigpo", "omega": 0.3, "step_std": False}),
        parse_estimator_config(
            {"estimator": "gagpo_lambda0", "omega_episode": 1.0, "norm": "batch"}
        ),
    ]
    # GiGPO as verl-agent computes it (sample stds, episode term over step rows).
    configs += [
        parse_estimator_config({"estimator": "gigpo", "variant": "verl_agent", "norm": norm})
        for norm in NORMS
    ]
    configs.append(
        parse_estimator_config(
            {"estimator": "gigpo", "variant": "verl_agent", "omega": 0.3, "step_std": False}
        )
    )
    return configs


CONFIGS = all_configs()
CONFIG_IDS = [
    f"{c.estimator}{'-' + c.variant if getattr(c, 'variant', 'paper') != 'paper' else ''}-{c.norm}-{i}"
    for i, c in enumerate(CONFIGS)
]

# --- the cases the issue lists ------------------------------------------------------------

CASES = {
    "terminal-and-truncated": {
        "g": [
            rollout("abc", [0, 0, 1], "done"),
            rollout("abd", [0, -0.1, 0], "truncated", "c"),
            rollout("ab", [0, 0.5], "truncated", "zzz-unseen"),
        ]
    },
    "truncated-next-state-seen-and-unseen": {
        "g1": [rollout("xy", [0, 0], "truncated", "x"), rollout("xz", [1, 0], "truncated", "w")],
        "g2": [rollout("xw", [0, 2], "truncated", "y"), rollout("x", [0], "done")],
    },
    "singleton-states": {"g": [rollout("abc", [1, 2, 3]), rollout("def", [0, 0, 1])]},
    "all-rollouts-same-states": {
        "g": [rollout("abcd", r) for r in ([0, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1])]
    },
    "state-twice-in-one-rollout": {
        "g": [rollout("abab", [0, 0, 0, 1]), rollout("aab", [0, 0.5, 0], "truncated", "a")]
    },
    "different-lengths": {
        "g": [rollout("a", [1]), rollout("ab", [0, 1]), rollout("abcdefg", [0, 0, 0, 0, 0, 0, 1])]
    },
    "group-size-one": {
        "solo": [rollout("abca", [0, 0.2, 0, 1])],
        "solo2": [rollout("q", [3], "truncated", "q")],
    },
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference(case, config):
    assert_matches_reference(steps_frame(CASES[case]), config)


def random_groups(seed: int, groups: int = 6) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    spec = {}
    for g in range(groups):
        alphabet = [f"s{i}" for i in range(rng.randint(1, 6))]
        rollouts = []
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 9)
            end = rng.choice(["done", "truncated"])
            rollouts.append(
                rollout(
                    [rng.choice(alphabet) for _ in range(n)],
                    [rng.choice([0.0, 1.0, -0.25, rng.uniform(-2, 2)]) for _ in range(n)],
                    end,
                    rng.choice([*alphabet, "elsewhere", None]) if end == "truncated" else None,
                )
            )
        spec[f"group-{seed}-{g}"] = rollouts
    return spec


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_random_batches_match_reference(seed, config):
    assert_matches_reference(steps_frame(random_groups(seed)), config)


@pytest.mark.parametrize("gamma, lam", [(0.95, 0.01), (0.5, 0.02), (0.99, 1.0), (1.0, 0.0)])
def test_long_rollout_is_exact(gamma, lam):
    """A 5,000-step rollout with small γλ: no underflow, the reference to 1e-9."""
    rng = random.Random(7)
    n = 5000
    states = [f"s{rng.randint(0, 300)}" for _ in range(n)]
    rewards = [rng.choice([0.0, 0.0, -0.01, 1.0]) for _ in range(n)]
    groups = {
        "long": [
            rollout(states, rewards, "done"),
            rollout(states[:40], rewards[:40], "truncated", states[40]),
        ]
    }
    for estimator in ("gagpo", "gigpo"):
        extra = {"lam": lam} if estimator == "gagpo" else {}
        config = parse_estimator_config({"estimator": estimator, "gamma": gamma, **extra})
        got = assert_matches_reference(steps_frame(groups), config)
        assert got[C.ADVANTAGE].is_finite().all()


def test_hand_computed_values():
    """Two rollouts meeting in state a; b is truncated into a state the group knows."""
    frame = steps_frame(
        {"g": [rollout(["a", "b"], [0, 1], "done"), rollout(["a", "c"], [0, 0], "truncated", "b")]}
    )
    config = parse_estimator_config(
        {"estimator": "gagpo", "gamma": 0.5, "lam": 1.0, "norm": "none"}
    )
    got = run(frame, config)
    # G: r0 = (0.5, 1), r1 = (0, 0); V(a) = 0.25, V(b) = 1, V(c) = 0.
    assert got[C.RETURN].to_list() == [0.5, 1.0, 0.0, 0.0]
    assert got[C.VALUE_PROXY].to_list() == [0.25, 1.0, 0.25, 0.0]
    assert got[C.STATE_GROUP_SIZE].to_list() == [2, 1, 2, 1]
    # r1 step 1 is truncated into b: next value V(b) = 1, so δ = 0 + 0.5·1 − 0.
    assert got[C.NEXT_VALUE_PROXY].to_list() == [1.0, 0.0, 0.0, 1.0]
    assert got[C.TD_RESIDUAL].to_list() == [0.25, 0.0, -0.25, 0.5]
    assert got[C.ADVANTAGE].to_list() == [0.25, 0.0, 0.0, 0.5]


def test_gigpo_variants_hand_computed():
    """Rollouts (a→b, R = 1) and (a, R = 0), γ = 1. Pool a holds returns {1, 0}; b is alone.
    paper: population stds, A_E over the two rollouts. verl_agent: sample stds, A_E over
    the three step rows (R = 1, 1, 0), as verl-agent's core_gigpo.py."""
    frame = steps_frame({"g": [rollout("ab", [0, 1]), rollout("a", [0])]})
    paper, verl = (
        parse_estimator_config({"estimator": "gigpo", "gamma": 1.0, "variant": variant})
        for variant in ("paper", "verl_agent")
    )
    # rows sorted (traj, step): r0 at a, r0 at b, r1 at a
    got = run(frame, paper)[C.ADVANTAGE].to_numpy()
    np.testing.assert_allclose(got, [1 + 1, 1 + 0, -1 - 1], atol=1e-5)
    step = 0.5 / np.sqrt(0.5)  # (1 − 0.5) / sample std of {1, 0}
    mean, std = 2 / 3, np.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # over the step rows
    got = run(frame, verl)[C.ADVANTAGE].to_numpy()
    expected = [(1 - mean) / std + step, (1 - mean) / std, (0 - mean) / std - step]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert verl.tag != paper.tag and "variant" not in paper.tag


def test_rows_keep_input_order_and_schema():
    frame = steps_frame(random_groups(3)).sample(fraction=1.0, shuffle=True, seed=1)
    out = compute_advantages(frame.lazy(), parse_estimator_config({})).collect()
    assert out.schema == pl.Schema(pl.from_arrow(C.ADVANTAGES_SCHEMA.empty_table()).schema)
    assert out.select(C.TRAJ_ID, C.STEP).equals(frame.select(C.TRAJ_ID, pl.col(C.STEP)))


def test_empty_input_gives_empty_table():
    frame = steps_frame({})
    out = compute_advantages(frame.lazy(), parse_estimator_config({})).collect()
    assert out.height == 0 and out.columns == list(C.ADVANTAGES_COLUMNS)


def test_diagnostics_per_group_and_batch():
    frame = steps_frame(
        {"a": CASES["terminal-and-truncated"]["g"], "b": CASES["singleton-states"]["g"]}
    )
    table = compute_advantages(frame.lazy(), parse_estimator_config({"norm": "batch"})).collect()
    diag = diagnostics(table)
    per_group = diag.groups.sort(C.GROUP_ID)
    assert per_group[C.GROUP_ID].to_list() == ["a", "b"]
    assert per_group["singleton_state_rate"].to_list()[1] == 1.0  # b never repeats a state
    assert per_group["steps"].to_list() == [8, 6]
    assert diag.batch["steps"] == frame.height
    assert diag.batch["groups"] == 2
    # In one group the singleton share is the share of steps with state_group_size 1.
    sizes = table[C.STATE_GROUP_SIZE]
    assert diag.batch["singleton_state_rate"] == pytest.approx((sizes == 1).mean())
    assert diag.batch["mean_pool_size"] == pytest.approx(sizes.mean())
    adv = table[C.ADVANTAGE].to_numpy()
    assert diag.batch["advantage_std"] == pytest.approx(adv.std())
    assert diag.batch["share_abs_gt_1"] == pytest.approx((np.abs(adv) > 1).mean())
    q75, q25 = np.percentile(adv, [75, 25])
    assert diag.batch["advantage_iqr"] == pytest.approx(q75 - q25)


def test_unknown_estimator_and_bad_parameter_are_one_line():
    with pytest.raises(GagpoError, match="accepted: gagpo, gagpo_lambda0"):
        parse_estimator_config({"estimator": "ppo"})
    with pytest.raises(GagpoError, match="'lam'"):
        parse_estimator_config({"estimator": "gagpo", "lam": 1.5})
    with pytest.raises(GagpoError, match="grpo has no parameter 'omega'"):
        parse_estimator_config({"estimator": "grpo", "omega": 1.0})


def test_gigpo_variant_flag(tmp_path):
    """`gagpo advantages --gigpo-variant verl_agent` writes the variant's values and tag;
    a bad value or another estimator gets one line and exit code 2."""
    from click.testing import CliRunner

    from gagpo.pipeline.cli import advantages

    frame = steps_frame(random_groups(11))
    frame.write_parquet(tmp_path / "steps.parquet")
    args = [
        "--input",
        str(tmp_path / "steps.parquet"),
        "--out",
        str(tmp_path / "a.parquet"),
        "--estimator",
        "gigpo",
        "--quiet",
    ]
    result = CliRunner().invoke(advantages, [*args, "--gigpo-variant", "verl_agent"])
    assert result.exit_code == 0, result.output
    assert "variant_verl_agent" in result.output
    written = pl.read_parquet(tmp_path / "a.parquet").sort(C.TRAJ_ID, C.STEP)
    config = parse_estimator_config({"estimator": "gigpo", "variant": "verl_agent"})
    expected = pl.DataFrame(reference_advantages(frame.to_dicts(), config)).sort(C.TRAJ_ID, C.STEP)
    np.testing.assert_allclose(written[C.ADVANTAGE], expected[C.ADVANTAGE], atol=1e-6)
    paper = run(frame, parse_estimator_config({"estimator": "gigpo"}))
    assert np.abs(paper[C.ADVANTAGE].to_numpy() - written[C.ADVANTAGE].to_numpy()).max() > 0.01
    for extra, message in (
        (["--gigpo-variant", "verl"], "'paper' or 'verl_agent'"),
        (["--estimator", "gagpo", "--gigpo-variant", "paper"], "no parameter"),
    ):
        result = CliRunner().invoke(advantages, [*args, *extra])
        assert result.exit_code != 0 and isinstance(result.exception, GagpoError), result.output
        assert message in str(result.exception)
