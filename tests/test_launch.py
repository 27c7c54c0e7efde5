"""The launcher contract of `gagpo run` (workflows/launch.py): both launchers hold it, the
`--ray` argument picks one, and the local one ends every process it started."""

from __future__ import annotations

import sys
import time

import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.launch import Launcher, LocalLauncher, RayLauncher, launcher_for
from gagpo.workflows.layout import Plan, Process
from gagpo.workflows.run import RunConfig
from tests.helpers.procs import alive


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


WAIT = _python("import time; print('waiting', flush=True); time.sleep(300)")
FAIL = _python("import sys; print('gagpo-actors: error: no such task'); sys.exit(2)")


def _pid(lines: list[str], prefix: str) -> list[int]:
    line = next(line for line in lines if line.startswith(prefix))
    return [int(p) for p in line.split("pid")[-1].strip(" s()").split(", ")]


def test_both_launchers_hold_the_contract():
    config = RunConfig()
    local = launcher_for(None, config, "S", "R", print)
    assert isinstance(local, LocalLauncher) and isinstance(local, Launcher)
    for ray, address in (("local", None), ("auto", "auto"), ("10.0.0.1:6379", "10.0.0.1:6379")):
        on_ray = launcher_for(ray, config, "S", "R", print)
        assert isinstance(on_ray, RayLauncher) and isinstance(on_ray, Launcher)
        assert on_ray.address == address and (on_ray.store, on_ray.run_id) == ("S", "R")


def test_the_local_launcher_returns_the_learners_code_and_stops_the_actors():
    plan = Plan(
        [
            Process("actor 0", WAIT),
            Process("actor 1", WAIT),
            Process("learner", _python("print('trained'); raise SystemExit(3)")),
        ]
    )
    lines: list[str] = []
    launcher = LocalLauncher(RunConfig(stop_timeout_s=10), lines.append)
    assert launcher.describe(plan) == plan.describe() and launcher.after() == []
    launcher.check(plan)  # no GPU asked for: nothing to refuse
    start = time.monotonic()
    assert launcher.run(plan) == 3
    assert time.monotonic() - start < 60  # the actors' SIGTERM, not their 300 s
    actors = _pid(lines, "2 actor(s) started")
    assert len(actors) == 2 and all(not alive(pid) for pid in actors)  # stopped and reaped
    assert "[learner] trained" in lines


def test_a_run_whose_actors_all_failed_raises_with_their_lines():
    plan = Plan([Process("actor 0", FAIL), Process("actor 1", FAIL), Process("learner", WAIT)])
    lines: list[str] = []
    with pytest.raises(GagpoError) as err:
        LocalLauncher(RunConfig(stop_timeout_s=10), lines.append).run(plan)
    assert str(err.value) == (
        "every actor exited with an error, so the learner was stopped; actor 0, actor 1 "
        "exited with 2: gagpo-actors: error: no such task"
    )
    assert not alive(_pid(lines, "learner started")[0])


def test_the_local_launcher_refuses_gpus_this_machine_lacks(monkeypatch):
    from gagpo.workflows import launch

    monkeypatch.setattr(launch, "gpus_visible", lambda config: 1)
    plan = Plan([Process("learner", WAIT)])
    with pytest.raises(
        GagpoError, match=r"run.learner_gpus names GPU 1 but 1 GPU\(s\) are visible"
    ):
        LocalLauncher(RunConfig(learner_gpus=[1]), print).check(plan)
    LocalLauncher(RunConfig(learner_gpus=[0]), print).check(plan)


def _store(tmp_path, env: str | None) -> str:
    import pyarrow as pa

    from gagpo.schemas import columns as C
    from gagpo.storage.store import Store
    from tests.helpers.steps import make_steps

    url = str(tmp_path / "store")
    if env is not None:
        steps = make_steps()
        i = steps.schema.get_field_index(C.ENV)
        steps = steps.set_column(i, C.ENV, pa.array([env] * steps.num_rows, pa.string()))
        Store(url).write_shard(steps, group_size=3)
    return url


def test_the_credit_step_asks_the_steps_environment_for_a_step_oracle(tmp_path):
    """After the run, credit is compared only for an environment that declares a step
    oracle, whichever the steps' environment is."""
    from gagpo.workflows.credit import oracle_env
    from gagpo.workflows.run import credit_lines

    assert oracle_env(_store(tmp_path / "a", "sokoban")) == "sokoban"
    none = _store(tmp_path / "b", "test")  # an environment without an oracle
    said: list[str] = []
    assert oracle_env(none) is None and credit_lines(none, None, said.append) == [] == said
    [line] = credit_lines(_store(tmp_path / "c", None), None, said.append)
    assert line.startswith("credit comparison: skipped (no committed shard in ") and not said
