"""verifiers v1 environments through the agent endpoint (issue 32): `--env verifiers:<taskset>`.

A multi-turn environment and taskset written the verifiers way (tests/helpers/verifiers_fixture.py)
play G rollouts a task into valid shards, every model call of an episode one step; each
rollout's reward is what verifiers recorded on its trace, and equals verifiers' own
scoring of that trace done again here. A failing episode loses its group alone; a taskset
that cannot load is one line (verifiers' TextArena taskset without its NLTK data).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("verifiers", reason="the verifiers extra is not installed")

from gagpo.actors.actor import run_actor
from gagpo.actors.config import ActorConfig
from gagpo.envs import check_env
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.actors import actor_config
from tests.helpers.steps import steps_of

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixture_on_path")
G = 4
ENV = "verifiers:verifiers_fixture"  # verifiers imports a taskset by a top-level name


@pytest.fixture(scope="module")
def fixture_on_path():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).parent / "helpers"))
        yield


def config(store: Path, **overrides) -> ActorConfig:
    base = dict(
        group_size=G,
        sampling={"max_new_tokens": 4},
        groups_in_flight=2,
        env_options={"traces": str(store / "traces"), "turn_timeout_s": 30},
    )
    return actor_config(store, ENV, **(base | overrides))


def rescored(record: dict) -> float:
    """verifiers' own scoring of a recorded trace, again: the task's rewards over it."""
    import verifiers.v1 as vf
    from verifiers_fixture import NumberData, NumberTask

    trace = vf.WireTrace.model_validate(record)
    trace.rewards = {}
    task = NumberTask(NumberData.model_validate(record["task"]["data"]))
    asyncio.run(task.score(trace))
    return trace.reward


def test_a_verifiers_environment_plays_into_valid_shards_with_verifiers_rewards(tmp_path: Path):
    from verifiers_fixture import TURNS

    summary = run_actor(config(tmp_path))
    assert (summary.groups, summary.rollouts, summary.groups_lost) == (3, 3 * G, 0)
    steps = steps_of(tmp_path).sort(C.TRAJ_ID, C.STEP)  # read_shard validates every shard
    assert sorted(set(steps[C.TASK_ID])) == [f"{ENV}-{s}" for s in (11, 12, 13)]
    # Every model call of an episode is a step: the first sees the task's prompt, the
    # later ones the user turn the environment's run() answered with.
    first = steps.filter(pl.col(C.STEP) == 0)[C.OBSERVATION]
    assert all(
        o.startswith("system: you play a guessing game .\n\nuser: guess my number") for o in first
    )
    later = set(steps.filter(pl.col(C.STEP) > 0)[C.OBSERVATION])
    assert later <= {"user: higher", "user: lower", "user: no number . say one"}
    rollouts = steps.group_by(C.TRAJ_ID, maintain_order=True).agg(
        pl.col(C.TASK_ID).first().str.split("-").list.last().cast(int).alias("seed"),
        pl.col(C.ACTION_TEXT),
        pl.col(C.REWARD).sum(),
        pl.col(C.DONE).last(),
        pl.col(C.TRUNCATED).any(),
        pl.col(C.STEP).max().alias("last"),
    )
    assert rollouts[C.DONE].all() and not rollouts[C.TRUNCATED].any()
    assert rollouts["last"].max() < TURNS
    # The reward is verifiers' trace reward, and that is verifiers' scoring of the trace.
    records = [json.loads(line) for line in (tmp_path / "traces" / "traces.jsonl").open()]
    assert len(records) == 3 * G and all(r["ok"] for r in records)
    by_play = {}
    for r in records:
        replies = tuple(n["message"]["content"] for n in r["trace"]["nodes"] if n.get("sampled"))
        trace_reward = sum(v["score"] * v["weight"] for v in r["trace"]["rewards"].values())
        assert rescored(r["trace"]) == pytest.approx(trace_reward)
        by_play[(r["task_seed"], replies)] = trace_reward
    assert len({round(v, 6) for v in by_play.values()}) > 1  # rewards that differ
    for row in rollouts.iter_rows(named=True):
        assert row[C.REWARD] == pytest.approx(by_play[(row["seed"], tuple(row[C.ACTION_TEXT]))])


def test_a_failing_episode_loses_its_group_alone_with_one_line(tmp_path: Path):
    """Task 13 is index 1 of the 12 tasks: its environment raises in run()."""
    warnings: list[str] = []
    overrides = {"env_options": {"taskset": {"fail_on": 1}, "turn_timeout_s": 30}, "groups": 4}
    summary = run_actor(config(tmp_path, **overrides), warn=warnings.append)
    assert (summary.groups, summary.groups_lost) == (3, 1), warnings
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "task seed 13" in warnings[0] and "the environment's own bug on task 1" in warnings[0]
    assert f"{ENV}-13" not in set(steps_of(tmp_path)[C.TASK_ID])


def test_names_that_verifiers_cannot_load_are_one_line():
    with pytest.raises(
        GagpoError,
        match="cannot be loaded: ModuleNotFoundError: taskset 'nowhere_taskset' not found",
    ):
        check_env("verifiers:nowhere_taskset", {})
    with pytest.raises(GagpoError, match="a top-level package or module name"):
        check_env("verifiers:tests.helpers.verifiers_fixture", {})
    with pytest.raises(GagpoError, match="taskset=3 is not valid"):
        check_env(ENV, {"taskset": 3})
    check_env(ENV, {"taskset": {"fail_on": 2}, "won_at": 0.5})


def test_the_textarena_taskset_without_its_nltk_data_is_one_line():
    """verifiers' TextArena taskset (the `ta` extra: textarena, nltk) downloads NLTK's
    `words` corpus in `load()`. Offline the download fails (nltk prints it and goes on),
    then TextArena's word list raises LookupError: the run stops before any group, in one
    line, rather than losing every group."""
    pytest.importorskip("textarena")
    nltk = pytest.importorskip("nltk")
    try:
        nltk.data.find("corpora/words")
        pytest.skip("NLTK's words corpus is installed here: the taskset loads")
    except LookupError:
        pass
    with pytest.raises(
        GagpoError,
        match=r"taskset 'textarena' failed to load its tasks: LookupError: Resource words not found",
    ):
        check_env("verifiers:textarena", {"taskset": {"game": "Wordle-v0"}})
