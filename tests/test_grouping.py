"""State grouping (pipeline/grouping.py): each mode on hand-made groups with known pools,
`similar` against a transcription of verl-agent's rule, `minhash` under row shuffles."""

from __future__ import annotations

import random
import statistics
import sys
from difflib import SequenceMatcher

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagpo.pipeline import compute_advantages, diagnostics, parse_estimator_config
from gagpo.pipeline.grouping import canonical_keys, parse_grouping
from gagpo.pipeline.minhash import band_rows, fingerprints, similarity, sketches
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.advantages import rollout, steps_frame

MODES = ("exact", "normalized", "similar:0.8", "minhash:0.6")


def run(frame: pl.DataFrame, mode: str, estimator: str = "gagpo", **params) -> pl.DataFrame:
    config = parse_estimator_config({"estimator": estimator, "state_grouping": mode, **params})
    return compute_advantages(frame, config, pool_ids=True).collect()


def pools_of(out: pl.DataFrame) -> set[frozenset[tuple[str, int]]]:
    """The partition of (traj_id, step) into pools, from the pool_id column."""
    parts = out.group_by(C.GROUP_ID, "pool_id").agg(pl.struct(C.TRAJ_ID, C.STEP))
    return {frozenset((r[C.TRAJ_ID], r[C.STEP]) for r in p) for p in parts[C.TRAJ_ID].to_list()}


# --- the setting -----------------------------------------------------------------------


def test_specs_parse_to_canonical_text_and_bad_ones_name_what_is_accepted():
    assert parse_grouping("similar:0.90").spec == "similar:0.9"
    assert parse_grouping(" minhash:1 ").spec == "minhash:1"
    assert parse_grouping("normalized:pkg.mod:fn").function == "pkg.mod:fn"
    for bad in (
        "fuzzy",
        "similar",
        "similar:0",
        "similar:1.5",
        "minhash:x",
        "exact:1",
        "normalized:mod",
    ):
        with pytest.raises(GagpoError, match="state_grouping"):
            parse_grouping(bad)
    with pytest.raises(GagpoError, match="state_grouping"):
        parse_estimator_config({"state_grouping": "similar:2"})


def test_exact_default_keeps_parameters_and_tags_and_other_modes_enter_both():
    default = parse_estimator_config({})
    exact = parse_estimator_config({"state_grouping": "exact"})
    assert default == exact and "state_grouping" not in default.params()
    assert "state_grouping" not in default.tag
    similar = parse_estimator_config({"estimator": "gigpo", "state_grouping": "similar:0.9"})
    assert similar.params()["state_grouping"] == "similar:0.9"
    assert "state_grouping_similar_0.9" in similar.tag and ":" not in similar.tag


def test_exact_is_bit_for_bit_the_stage_without_grouping():
    rng = random.Random(3)
    groups = {
        f"g{g}": [
            rollout(
                [f"s{rng.randint(0, 3)}" for _ in range(n)],
                [rng.random() for _ in range(n)],
                end=rng.choice(["done", "truncated"]),
                next_state=f"s{rng.randint(0, 4)}",
            )
            for n in (rng.randint(1, 6) for _ in range(4))
        ]
        for g in range(5)
    }
    frame = steps_frame(groups)
    for estimator in ("gagpo", "gigpo", "grpo"):
        base = compute_advantages(frame, parse_estimator_config({"estimator": estimator}))
        out = run(frame, "exact", estimator)
        assert out.drop("pool_id").equals(base.collect())
        assert out["pool_id"].equals(out[C.STATE_KEY], check_names=False)


# --- hand-made groups ----------------------------------------------------------------


HAND = {
    "g1": [
        rollout(["Turn 1: You are in the Kitchen.", "Turn 2: a red door", "end"], [0, 0, 1]),
        rollout(["turn 7:  you are in the kitchen. ", "Turn 3: a red  door", "END"], [0, 0, 0]),
        rollout(["Turn 1: You are in the Kitchen!", "a blue window", "fin"], [0, 0, 0.5]),
    ],
    "g2": [  # the same keys in another group: never pooled with g1
        rollout(["Turn 1: You are in the Kitchen.", "Turn 2: a red door"], [0, 1]),
    ],
}


def test_normalized_folds_case_digits_and_whitespace_only():
    assert canonical_keys(pl.Series(["  Step 12\tof 3 ", "STEP 9 of 44"])).to_list() == [
        "step # of #",
        "step # of #",
    ]
    out = run(steps_frame(HAND), "normalized")
    sizes = dict(
        zip(zip(out[C.TRAJ_ID], out[C.STEP], strict=True), out[C.STATE_GROUP_SIZE], strict=True)
    )
    assert sizes[("g1/r0", 0)] == 2 and sizes[("g1/r1", 0)] == 2  # '!' is not folded
    assert sizes[("g1/r2", 0)] == 1
    assert sizes[("g1/r0", 1)] == 2 and sizes[("g1/r0", 2)] == 2  # end / END
    assert sizes[("g2/r0", 0)] == 1  # groups never mix
    assert out.filter(pl.col(C.TRAJ_ID) == "g1/r0")["pool_id"][1] == "turn #: a red door"


def test_normalized_with_a_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_keys.py").write_text(
        "def first_word(key):\n    return key.split()[0].lower()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = run(steps_frame(HAND), "normalized:my_keys:first_word")
    g1 = out.filter(pl.col(C.GROUP_ID) == "g1")
    assert g1.filter(pl.col("pool_id") == "turn").height == 5  # every 'Turn …' key of g1
    with pytest.raises(GagpoError, match="cannot load"):
        run(steps_frame(HAND), "normalized:my_keys:missing")
    sys.modules.pop("my_keys", None)


def test_similar_pools_against_hand_ratios():
    out = run(steps_frame(HAND), "similar:0.9")
    parts = pools_of(out)
    assert frozenset({("g1/r0", 0), ("g1/r2", 0)}) in parts  # 'Kitchen.' vs 'Kitchen!'
    assert frozenset({("g1/r0", 1), ("g1/r1", 1)}) in parts  # one digit and a space apart
    assert frozenset({("g1/r1", 0)}) in parts  # case and spacing: ratio < 0.9
    assert frozenset({("g2/r0", 0)}) in parts and frozenset({("g2/r0", 1)}) in parts


def test_minhash_merges_near_duplicates_transitively_and_never_across_groups():
    body = "you are in a long corridor with doors to the north, east and a locked gate " * 2
    a, b, c = f"[t=1] {body}", f"[t=22] {body}", f"[t=333] {body}"
    groups = {
        "g1": [
            rollout([a, "alpha beta gamma delta"], [0, 1]),
            rollout([b, "zzzz"], [0, 0]),
            rollout([c, "omega"], [0, 0]),
        ],
        "g2": [rollout([a, "q"], [0, 1])],
    }
    out = run(steps_frame(groups), "minhash:0.8")
    parts = pools_of(out)
    assert frozenset({("g1/r0", 0), ("g1/r1", 0), ("g1/r2", 0)}) in parts
    assert frozenset({("g2/r0", 0)}) in parts
    assert out.filter(pl.col(C.GROUP_ID) == "g1")["pool_id"][0] == min(a, b, c)
    assert out.filter(pl.col(C.STEP) == 1)[C.STATE_GROUP_SIZE].to_list() == [1, 1, 1, 1]


def test_truncated_next_state_is_mapped_through_the_grouping():
    groups = {
        "g": [
            rollout(["Room 1", "Hall 7"], [0, 1.0]),
            rollout(["room 2"], [0.0], end="truncated", next_state="hall 99"),
            rollout(["room 3"], [0.0], end="truncated", next_state="garden"),
        ]
    }
    frame = steps_frame(groups)
    by_mode = {m: run(frame, m, gamma=1.0) for m in ("exact", "normalized", "similar:0.6")}
    ends = {
        m: o.filter(frame[C.TRUNCATED])[C.NEXT_VALUE_PROXY].to_list() for m, o in by_mode.items()
    }
    assert ends["exact"] == [0.0, 0.0]
    assert ends["normalized"] == [1.0, 0.0]  # 'hall 99' → 'hall #', the pool of 'Hall 7'
    hall = SequenceMatcher(None, "hall 99", "Hall 7").ratio()
    assert hall >= 0.6 and ends["similar:0.6"][0] == 1.0 and ends["similar:0.6"][1] == 0.0


def test_minhash_maps_a_near_duplicate_next_state_and_not_an_unrelated_one():
    body = "the shop lists: red shirt 12 dollars, blue shirt 15 dollars, green hat 3 dollars"
    groups = {
        "g": [
            rollout([f"page 1 {body}"], [1.0]),
            rollout(["start"], [0.0], end="truncated", next_state=f"page 2 {body}"),
            rollout(["start"], [0.0], end="truncated", next_state="an unrelated page"),
        ]
    }
    frame = steps_frame(groups)
    out = run(frame, "minhash:0.7", gamma=1.0)
    assert out.filter(frame[C.TRUNCATED])[C.NEXT_VALUE_PROXY].to_list() == [1.0, 0.0]


# --- similar:τ against verl-agent's rule ----------------------------------------------


def verl_agent_step_groups(anchor_obs: list[str], index: list[str], thresh: float) -> list:
    """A transcription of the rule of verl-agent's `build_step_group` with
    enable_similarity (gigpo/core_gigpo.py): for each episode group (in np.unique order),
    its rows in batch order; a row joins the first cluster whose representative (its
    first member) gives SequenceMatcher(None, obs, rep).ratio() >= thresh, otherwise it
    founds a cluster. Returns a cluster id per row."""
    uid: list = [None] * len(anchor_obs)
    for idx in sorted(set(index)):
        clusters: list[tuple[str, list[int]]] = []
        for loc in (i for i, x in enumerate(index) if x == idx):
            obs = anchor_obs[loc]
            for rep, locs in clusters:
                if SequenceMatcher(None, obs, rep).ratio() >= thresh:
                    locs.append(loc)
                    break
            else:
                clusters.append((obs, [loc]))
        for k, (_, locs) in enumerate(clusters):
            for loc in locs:
                uid[loc] = (idx, k)
    return uid


def partition(labels: list) -> set[frozenset[int]]:
    parts: dict = {}
    for i, label in enumerate(labels):
        parts.setdefault(label, set()).add(i)
    return {frozenset(p) for p in parts.values()}


def one_step_frame(keys: list[str], groups: list[str], returns: list[float]) -> pl.DataFrame:
    """Every row its own one-step rollout (so the row order is the batch order)."""
    n = len(keys)
    return pl.DataFrame(
        {
            C.GROUP_ID: groups,
            C.TRAJ_ID: [f"t{i}" for i in range(n)],
            C.STEP: pl.Series([0] * n, dtype=pl.Int32),
            C.STATE_KEY: keys,
            C.NEXT_STATE_KEY: pl.Series([None] * n, dtype=pl.String),
            C.REWARD: pl.Series(returns, dtype=pl.Float32),
            C.DONE: [True] * n,
            C.TRUNCATED: [False] * n,
        }
    )


def shared_cases(seed: int, n: int = 60) -> tuple[list[str], list[str]]:
    """Near-duplicates over a small alphabet, some long enough (> 200) for difflib's
    autojunk, asymmetric pairs, repeats, empty keys; three groups interleaved."""
    rng = random.Random(seed)
    bases = [
        "".join(rng.choice("abcde ") for _ in range(rng.choice([3, 12, 40, 230]))) for _ in range(5)
    ]
    keys = []
    for _ in range(n):
        key = list(rng.choice(bases))
        for _ in range(rng.randint(0, max(1, len(key) // 6))):
            if key:
                key[rng.randrange(len(key))] = rng.choice("abcdexyz")
        keys.append("".join(key) if rng.random() > 0.03 else "")
    keys += [keys[0], keys[1]]  # repeats
    groups = [rng.choice(["A", "B", "C"]) for _ in keys]
    return keys, groups


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.5, 0.75, 0.9])
def test_similar_matches_verl_agent_rule_on_shared_cases(seed, tau):
    keys, groups = shared_cases(seed)
    frame = one_step_frame(keys, groups, [0.0] * len(keys))
    out = run(frame, f"similar:{tau}")
    expected = partition(verl_agent_step_groups(keys, groups, tau))
    assert partition(list(zip(out[C.GROUP_ID], out["pool_id"], strict=True))) == expected


def test_similar_quirks_asymmetry_and_row_order():
    # ratio(a, b) != ratio(b, a) once b is long enough for autojunk to junk its spaces
    a = "x " * 30 + "y" * 5
    b = "x " * 110 + "y" * 5
    r_ab, r_ba = SequenceMatcher(None, a, b).ratio(), SequenceMatcher(None, b, a).ratio()
    assert r_ab != r_ba
    tau = (r_ab + r_ba) / 2
    for keys in ([a, b], [b, a]):
        frame = one_step_frame(keys, ["g", "g"], [0.0, 1.0])
        got = partition(run(frame, f"similar:{tau:.6f}")["pool_id"].to_list())
        assert got == partition(verl_agent_step_groups(keys, ["g", "g"], float(f"{tau:.6f}")))
    # order matters: aabb is 0.75 from aaab but 0.5 from aaaa, the first member
    keys = ["aaaa", "aaab", "aabb"]
    first = partition(
        run(one_step_frame(keys, ["g"] * 3, [0.0] * 3), "similar:0.7")["pool_id"].to_list()
    )
    order = [1, 0, 2]
    second = run(one_step_frame([keys[i] for i in order], ["g"] * 3, [0.0] * 3), "similar:0.7")
    assert first == {frozenset({0, 1}), frozenset({2})}
    assert partition(second["pool_id"].to_list()) == {frozenset({0, 1, 2})}


def verl_agent_step_advantage(returns: list[float], uid: list, eps: float = 1e-6) -> list[float]:
    """verl-agent's step_norm_reward with std: (G − mean) / (std + ε) per step group,
    torch.std (Bessel); a single-member group gets mean = its own value, std 1 → 0."""
    members: dict = {}
    for value, label in zip(returns, uid, strict=True):
        members.setdefault(label, []).append(value)
    out = []
    for value, label in zip(returns, uid, strict=True):
        vs = members[label]
        std = statistics.stdev(vs) if len(vs) > 1 else 1.0
        out.append((value - statistics.fmean(vs)) / (std + eps))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_gigpo_step_advantage_under_similar_matches_verl_agent(seed):
    keys, groups = shared_cases(seed)
    rng = random.Random(seed)
    returns = [float(rng.choice([0.0, 0.5, 1.0])) for _ in keys]
    frame = one_step_frame(keys, groups, returns)
    out = run(frame, "similar:0.75", "gigpo", variant="verl_agent", gamma=1.0)
    expected = verl_agent_step_advantage(returns, verl_agent_step_groups(keys, groups, 0.75))
    np.testing.assert_allclose(out[C.ADVANTAGE_RAW].to_numpy(), expected, rtol=1e-4, atol=1e-4)
    singles = out.filter(pl.col(C.STATE_GROUP_SIZE) == 1)
    assert singles.height and (singles[C.ADVANTAGE_RAW] == 0).all()


# --- minhash:τ: the pieces, and order independence ------------------------------------


def test_sketch_similarity_estimates_jaccard():
    text = "you see a drawer 1, a cabinet 2, a countertop 3 and a sink basin 4 in the room"
    s = sketches(pl.Series([text, text, text.replace("drawer", "fridge"), "zq", "", "zq"]))
    assert similarity(s[[0]], s[[1]])[0] == 1.0
    truth = _jaccard(text, text.replace("drawer", "fridge"))
    assert abs(similarity(s[[0]], s[[2]])[0] - truth) < 0.15
    assert similarity(s[[3]], s[[5]])[0] == 1.0 and similarity(s[[3]], s[[4]])[0] == 0.0
    assert band_rows(0.8) == 4 and band_rows(0.95) > band_rows(0.5)


def _jaccard(a: str, b: str) -> float:
    sa = {a.encode()[i : i + 4] for i in range(len(a.encode()) - 3)}
    sb = {b.encode()[i : i + 4] for i in range(len(b.encode()) - 3)}
    return len(sa & sb) / len(sa | sb)


def noisy_groups(seed: int) -> pl.DataFrame:
    """Observation-like keys with counters and small edits, rollouts of 1–6 steps."""
    rng = random.Random(seed)
    rooms = ["kitchen with a fridge and a stove", "hall with a coat rack", "garden, a hose"]
    groups = {}
    for g in range(4):
        rollouts = []
        for _ in range(5):
            n = rng.randint(1, 6)
            states = [
                f"step {t + rng.randint(0, 2)}: you are in the {rng.choice(rooms)}"
                f"{rng.choice(['', '.', ' now'])}"
                for t in range(n)
            ]
            rollouts.append(
                rollout(
                    states,
                    [rng.random() for _ in range(n)],
                    end=rng.choice(["done", "truncated"]),
                    next_state=f"step {n}: you are in the {rng.choice(rooms)}",
                )
            )
        groups[f"g{g}"] = rollouts
    return steps_frame(groups)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shuffle=st.randoms(use_true_random=False))
def test_minhash_is_deterministic_under_row_shuffles(seed, shuffle):
    frame = noisy_groups(seed % 50)
    order = list(range(frame.height))
    shuffle.shuffle(order)
    base = run(frame, "minhash:0.6").sort(C.TRAJ_ID, C.STEP)
    shuffled = run(frame[order], "minhash:0.6").sort(C.TRAJ_ID, C.STEP)
    # the same pools and labels; values up to the order of floating-point sums
    assert base.select("pool_id", C.STATE_GROUP_SIZE).equals(
        shuffled.select("pool_id", C.STATE_GROUP_SIZE)
    )
    for name in (C.VALUE_PROXY, C.NEXT_VALUE_PROXY, C.ADVANTAGE):
        np.testing.assert_allclose(base[name].to_numpy(), shuffled[name].to_numpy(), atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_exact_on_keys_relabelled_by_pool(mode):
    """The grouping only decides pools: exact grouping on (group, pool_id) as the key
    gives the same table, truncated ends included (their next key mapped likewise)."""
    frame = noisy_groups(7)
    out = run(frame, mode)
    again = run(frame.with_columns(out["pool_id"].alias(C.STATE_KEY)), "exact")
    keep = [C.STATE_GROUP_SIZE, C.VALUE_PROXY, C.RETURN]
    assert again.select(keep).equals(out.select(keep))
    # away from truncated ends (whose raw next_state_key the relabelling leaves) all agree
    inner = ~frame[C.TRUNCATED]
    assert again.filter(inner)[C.TD_RESIDUAL].equals(out.filter(inner)[C.TD_RESIDUAL])


@pytest.mark.parametrize("mode", MODES)
def test_pools_never_cross_groups(mode):
    frame = noisy_groups(11)
    copy = frame.with_columns(
        (pl.col(C.GROUP_ID) + "-copy").alias(C.GROUP_ID),
        (pl.col(C.TRAJ_ID) + "-copy").alias(C.TRAJ_ID),
    )
    out = run(pl.concat([frame, copy]), mode)
    per_pool = out.group_by(C.GROUP_ID, "pool_id").agg(pl.len())
    total = out.group_by(C.GROUP_ID, "pool_id").agg(pl.col(C.STATE_GROUP_SIZE).first())
    assert (
        per_pool.join(total, on=[C.GROUP_ID, "pool_id"])
        .filter(pl.col("len") != pl.col(C.STATE_GROUP_SIZE))
        .is_empty()
    )
    original = out.head(frame.height).drop(C.GROUP_ID, C.TRAJ_ID)
    assert original.equals(out.tail(frame.height).drop(C.GROUP_ID, C.TRAJ_ID))


def test_diagnostics_report_the_singleton_share_and_pool_sizes_per_mode():
    frame = noisy_groups(5)
    shares = {
        m: diagnostics(run(frame, m).drop("pool_id")).batch["singleton_state_rate"] for m in MODES
    }
    assert shares["exact"] >= shares["normalized"]
    assert shares["exact"] > shares["minhash:0.6"]
    diag = diagnostics(run(frame, "normalized").drop("pool_id"))
    assert "pool_size_share" in diag.format()
    assert abs(sum(diag.batch["pool_size_share"].values()) - 1.0) < 1e-9


# --- the command and its output ------------------------------------------------------


def test_cli_flag_writes_pool_ids_and_prints_pool_sizes(tmp_path):
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from gagpo.pipeline.cli import advantages

    steps = tmp_path / "steps.parquet"
    noisy_groups(3).write_parquet(steps)
    runner = CliRunner()
    exact = runner.invoke(advantages, ["--input", str(steps), "--out", str(tmp_path / "e.parquet")])
    assert exact.exit_code == 0, exact.output
    assert "pool_id" not in pq.read_schema(tmp_path / "e.parquet").names  # exact: as before
    out = tmp_path / "m.parquet"
    result = runner.invoke(
        advantages, ["--input", str(steps), "--out", str(out), "--state-grouping", "minhash:0.6"]
    )
    assert result.exit_code == 0, result.output
    assert "state_grouping        minhash:0.6" in result.output
    assert "pool_size_share" in result.output and "state_grouping_minhash_0.6" in result.output
    table = pl.read_parquet(out)
    assert table.columns[-1] == "pool_id" and table["pool_id"].null_count() == 0
    bad = runner.invoke(
        advantages, ["--input", str(steps), "--out", str(out), "--state-grouping", "fuzzy"]
    )
    assert bad.exit_code != 0 and "unknown state_grouping" in str(bad.exception)


def test_state_pools_view_shows_the_mode_and_which_states_were_merged(tmp_path):
    from gagpo.inspection import sql
    from gagpo.pipeline.recompute import recompute_store
    from gagpo.storage.store import Store
    from tests.helpers.steps import make_steps

    store = Store(str(tmp_path / "store"))
    shard = pl.from_arrow(make_steps(shard_id="x1", groups=2, group_size=3))
    # every state key gets a per-rollout counter: exact pools are singletons, normalized merges
    shard = shard.with_columns(
        pl.format("{} turn {}", pl.col(C.STATE_KEY), pl.col(C.TRAJ_ID).rank("dense")).alias(
            C.STATE_KEY
        ),
        pl.lit(None, pl.String).alias(C.NEXT_STATE_KEY),
    )
    store.write_shard(shard.to_arrow(), group_size=3)
    for mode in ("exact", "normalized"):
        recompute_store(str(store.root), None, parse_estimator_config({"state_grouping": mode}))
    con = sql.open_store_db(store)
    try:
        rows = sql.run_query(
            con,
            "SELECT estimator, state_grouping, state_key, pool_id, visits, pool_visits, "
            "pool_states FROM state_pools ORDER BY estimator, group_id, state_key",
        ).to_pylist()
    finally:
        sql.close_store_db(con)
    modes = {r["estimator"]: r["state_grouping"] for r in rows}
    assert sorted(set(modes.values())) == ["exact", "normalized"]
    exact = [r for r in rows if r["state_grouping"] == "exact"]
    assert all(r["pool_id"] == r["state_key"] and r["pool_states"] == 1 for r in exact)
    merged = [r for r in rows if r["state_grouping"] == "normalized"]
    assert any(r["pool_states"] > 1 for r in merged)
    assert all(r["pool_id"] == canonical_keys(pl.Series([r["state_key"]]))[0] for r in merged)
    assert all(r["pool_visits"] >= r["visits"] for r in merged)


def test_report_shows_singleton_share_and_pool_sizes_per_mode():
    """gagpo report's State grouping table: one grouping pass per mode over the steps."""
    import duckdb

    from gagpo.inspection.report_summary import grouping_rows

    steps = pl.DataFrame(
        {
            "group_id": ["g"] * 4 + ["h"] * 2,
            "step": [0, 1, 0, 1, 0, 1],
            "state_key": [
                "Turn 0 hall",
                "Turn 1 attic",
                "Turn 0 hall",
                "Turn 2 attic",
                "Turn 0 hall",
                "Turn 1 attic",
            ],
        }
    )
    con = duckdb.connect()
    con.register("steps_df", steps.to_arrow())
    con.execute("CREATE TABLE steps AS SELECT * FROM steps_df")
    con.execute('CREATE TABLE estimators AS SELECT \'{"state_grouping": "minhash:0.6"}\' AS params')
    rows = {r["state_grouping"]: r for r in grouping_rows(con)}
    assert list(rows) == ["exact", "normalized", "minhash:0.8", "similar:0.9", "minhash:0.6"]
    exact, normalized = rows["exact"], rows["normalized"]
    # exact: g has {hall ×2}, {attic 1}, {attic 2}; h has {hall}, {attic 1}: 4 singletons of 6
    assert exact["pools"] == 5 and exact["singleton_share"] == pytest.approx(4 / 6)
    assert exact["singleton_share_after_turn_0"] == pytest.approx(1.0)
    assert exact["pool_1"] == pytest.approx(4 / 6) and exact["pool_2-3"] == pytest.approx(2 / 6)
    # normalized: the turn counters go, g pools 2 + 2, h's two steps stay apart (two states)
    assert normalized["pools"] == 4 and normalized["singleton_share"] == pytest.approx(2 / 6)
    assert normalized["pool_2-3"] == pytest.approx(4 / 6) and normalized["pool_8+"] == 0.0


def test_fast_canonical_keys_equal_the_regex_rule():
    """normalized's byte path equals canonical_keys (the Polars regexes) string for string,
    ASCII whitespace and digits of every kind, non-ASCII keys, nulls and a sliced series."""
    from gagpo.pipeline.canonical import canonical_keys_fast

    rng = random.Random(3)
    alphabet = "aB9 \t\n\x0b\x0c\r\x1c07Zz#é١\u00a0\u2003x"
    for _ in range(200):
        keys = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
            for _ in range(rng.randrange(30))
        ]
        series = pl.Series([None if rng.random() < 0.1 else k for k in keys], dtype=pl.String)
        if series.len() > 2:
            series = series.slice(1, series.len() - 2)
        assert canonical_keys_fast(series).to_list() == canonical_keys(series).to_list()


def test_minhash_blocks_of_groups_give_the_single_pass_result(monkeypatch):
    """minhash works over blocks of whole groups; tiny blocks change nothing."""
    import gagpo.pipeline.minhash as minhash
    from gagpo.pipeline.grouping import group_states

    rng = random.Random(5)
    words = ["red", "blue", "box", "door", "key", "turn", "open", "shut"]
    gid = np.array(sorted(rng.randrange(40) for _ in range(600)))
    keys = pl.Series([" ".join(rng.choice(words) for _ in range(6)) for _ in range(600)])
    q_gid = np.array([rng.randrange(40) for _ in range(50)])
    queries = pl.Series([" ".join(rng.choice(words) for _ in range(6)) for _ in range(50)])
    mode = parse_grouping("minhash:0.5")
    whole = group_states(mode, gid, keys, q_gid, queries)
    monkeypatch.setattr(minhash, "_BLOCK_KEYS", 7)
    blocks = group_states(mode, gid, keys, q_gid, queries)
    assert (blocks.pool == whole.pool).all() and (blocks.query_pool == whole.query_pool).all()
    assert blocks.label().to_list() == whole.label().to_list()


def _sketch_reference(key: str) -> list[int]:
    """A sketch by its definition (pipeline/minhash.py), in plain Python."""
    data = key.encode()
    if len(data) < 4:  # one shingle: the bytes, and the length + 1 above them
        shingles = [int.from_bytes(data, "little") | (len(data) + 1) << 32]
    else:
        shingles = [int.from_bytes(data[i : i + 4], "little") for i in range(len(data) - 3)]
    row = [0xFFFFFFFF] * 64
    for x in shingles:
        h = ((x * 0x9E3779B97F4A7C15) % 2**64 >> 32) & 0xFFFFFFFE
        row[h >> 26] = min(row[h >> 26], h)
    return row


def _fnv1a(key: str) -> int:
    h = 0xCBF29CE484222325
    for byte in key.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def test_sketches_and_fingerprints_equal_their_definition():
    """Short, empty and non-ASCII keys included; blocks of keys sketch as one pass."""
    rng = random.Random(9)
    words = ["red", "blue", "box", "door", "key", "a", "", "turn 12", "é", "日本"]
    keys = [" ".join(rng.choice(words) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    got = sketches(pl.Series(keys))
    assert got.tolist() == [_sketch_reference(k) for k in keys]
    assert fingerprints(pl.Series(keys)).tolist() == [_fnv1a(k) for k in keys]
    assert (sketches(pl.Series(keys[100:])) == got[100:]).all()  # an offset slice


def test_bucket_hashes_are_equal_exactly_where_bands_are():
    """Two keys share a band's bucket when the band's bins are equal (and never a bucket
    of empty bins: those bands are flagged)."""
    from gagpo.pipeline.minhash import EMPTY, bucket_hashes

    rng = np.random.default_rng(2)
    sketch = rng.integers(0, 5, size=(200, 64)).astype(np.uint32) * np.uint32(7919)
    sketch[rng.random((200, 64)) < 0.3] = EMPTY
    sketch[50:60, :16] = EMPTY  # whole empty bands
    for rows in (1, 2, 4, 8):
        bucket, empty = bucket_hashes(sketch, rows)
        bands = sketch.reshape(200, 64 // rows, rows)
        assert (empty == (bands == EMPTY).all(axis=2).T).all()
        for j in range(64 // rows):
            same_bins = (bands[:, None, j] == bands[None, :, j]).all(axis=2)
            assert ((bucket[j][:, None] == bucket[j][None, :]) == same_bins).all()


def _minhash_reference(gid, keys, q_gid, queries, tau):
    """minhash:τ by its definition, in plain Python: per group, band and LSH bucket the
    key of least fingerprint is the head; every key is linked to the heads of its
    non-empty bands when the estimated Jaccard is >= τ; pools are the connected
    components, labelled by their smallest key. A query is compared with every key of
    its group that shares one of its buckets; the best (highest estimate, then the
    component whose least-fingerprint key has the least fingerprint) is its pool.
    Returns each key's label (index of its component's smallest key) and each query's
    (None if none)."""
    rows = band_rows(tau)
    sketch = [_sketch_reference(k) for k in keys]
    q_sketch = [_sketch_reference(q) for q in queries]
    fp = [_fnv1a(k) for k in keys]

    def band(s, j):
        return tuple(s[j * rows : (j + 1) * rows])

    def live(s, j):
        return any(b != 0xFFFFFFFF for b in band(s, j))

    def sim(a, b):
        either = sum(x != 0xFFFFFFFF or y != 0xFFFFFFFF for x, y in zip(a, b, strict=True))
        both = sum(x == y != 0xFFFFFFFF for x, y in zip(a, b, strict=True))
        return both / max(either, 1)

    heads = {}
    for k in sorted(range(len(keys)), key=lambda k: fp[k]):
        for j in range(64 // rows):
            if live(sketch[k], j):
                heads.setdefault((gid[k], j, band(sketch[k], j)), k)
    parent = list(range(len(keys)))

    def root(k):
        while parent[k] != k:
            k = parent[k]
        return k

    for k in range(len(keys)):
        for j in range(64 // rows):
            head = heads.get((gid[k], j, band(sketch[k], j)))
            if live(sketch[k], j) and head != k and sim(sketch[k], sketch[head]) >= tau:
                parent[root(k)] = root(head)
    members = {}
    for k in range(len(keys)):
        members.setdefault(root(k), []).append(k)
    label = [min(members[root(k)], key=lambda m: keys[m]) for k in range(len(keys))]
    first = [min(members[root(k)], key=lambda m: fp[m]) for k in range(len(keys))]
    found = []
    for q in range(len(queries)):
        best = None
        for k in range(len(keys)):
            share = any(
                live(sketch[k], j) and band(sketch[k], j) == band(q_sketch[q], j)
                for j in range(64 // rows)
            )
            score = sim(q_sketch[q], sketch[k])
            if gid[k] != q_gid[q] or not share or score < tau:
                continue
            if best is None or (-score, fp[first[k]]) < best[0]:
                best = ((-score, fp[first[k]]), label[k])
        found.append(None if best is None else best[1])
    return label, found


def _words_groups(rng: random.Random, groups: int, most: int):
    words = ["red", "blue", "box", "door", "key", "turn 1", "turn 2", "open"]
    gid, keys = [], []
    for g in range(groups):
        seen = set()
        for _ in range(rng.randrange(1, most)):
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 7)))
            if text not in seen:
                seen.add(text)
                gid.append(g)
                keys.append(text)
    q_gid = [rng.randrange(groups) for _ in range(40)]
    queries = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 7))) for _ in q_gid]
    return gid, keys, q_gid, queries


@pytest.mark.parametrize("tau", [0.5, 0.6, 0.8])
@pytest.mark.parametrize("most", [30, 400])
def test_minhash_equals_its_definition_in_plain_python(tau, most, monkeypatch):
    """The bucket-head tables, the skipped links and bands, the union-find and the
    queries give what the definition gives, with one block or many, in small groups and
    in large ones (crowded head tables)."""
    import gagpo.pipeline.minhash as minhash
    from gagpo.pipeline.grouping import group_states

    rng = random.Random(int(tau * 10) + most)
    gid, keys, q_gid, queries = _words_groups(rng, 12 if most < 100 else 3, most)
    label, found = _minhash_reference(gid, keys, q_gid, queries, tau)
    for block in (4096, 5):
        monkeypatch.setattr(minhash, "_BLOCK_KEYS", block)
        pools = group_states(
            parse_grouping(f"minhash:{tau}"),
            np.array(gid),
            pl.Series(keys),
            np.array(q_gid),
            pl.Series(queries),
        )
        names = pools.label().to_list()
        assert [names[p] for p in pools.pool] == [keys[k] for k in label]
        assert [None if p < 0 else names[p] for p in pools.query_pool] == [
            None if k is None else keys[k] for k in found
        ]


def test_minhash_without_numba_says_what_to_install(monkeypatch):
    from gagpo.pipeline.grouping import group_states

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.delitem(sys.modules, "gagpo.pipeline.minhash", raising=False)
    with pytest.raises(GagpoError, match=r"minhash need numba.*pip install"):
        group_states(
            parse_grouping("minhash:0.8"),
            np.array([0, 0]),
            pl.Series(["a b", "a c"]),
            np.array([], np.int64),
            pl.Series([], dtype=pl.String),
        )


def test_minhash_orders_keys_the_same_whether_or_not_groups_come_sorted():
    """minhash_pools takes keys group by group as they come when the groups come in order (as
    exact pools do) and sorts them by group otherwise: the same components and query
    pools either way."""
    import gagpo.pipeline.minhash as minhash

    rng = random.Random(11)
    words = ["red", "blue", "box", "door", "key", "turn 1", "turn 2", "open"]
    gid = np.array(sorted(rng.randrange(6) for _ in range(120)))
    keys = [" ".join(rng.choice(words) for _ in range(5)) + f" {i}" for i in range(120)]
    q_gid = np.array([rng.randrange(6) for _ in range(20)])
    queries = pl.Series([" ".join(rng.choice(words) for _ in range(5)) for _ in q_gid])
    merged, found = minhash.minhash_pools(pl.Series(keys), gid, 0.5, queries, q_gid)
    perm = np.random.default_rng(0).permutation(120)
    merged_p, found_p = minhash.minhash_pools(
        pl.Series(keys).gather(perm), gid[perm], 0.5, queries, q_gid
    )
    assert [keys[perm[m]] for m in merged_p] == [keys[m] for m in merged[perm]]
    as_key = [None if f < 0 else keys[f] for f in found]
    assert [None if f < 0 else keys[perm[f]] for f in found_p] == as_key
