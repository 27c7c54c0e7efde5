"""The launcher contract of `gagpo run` (workflows/launch.py): both launchers hold it, the
`--ray` argument picks one, and the local one ends every process it started; the child
process both launchers start their processes with (workflows/child.py)."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.workflows.child import Child
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


def test_the_ray_launcher_opens_the_store_once(tmp_path):
    """Given a Store it uses that one; given a URL it opens it when first needed, once, and
    reads the closing line from it (a run that never started records nothing)."""
    from gagpo.storage.store import Store

    store = Store(str(tmp_path / "s"))
    assert launcher_for("local", RunConfig(), store, "R", print).opened is store
    by_url = launcher_for("local", RunConfig(), str(tmp_path / "s"), "R", print)
    assert by_url.opened is by_url.opened and by_url.opened.url == store.url
    assert by_url.after() == [
        "ray restarts: not recorded (the run ended before its Ray actors started)"
    ]


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


# --- the child process ------------------------------------------------------------------------


class _Lines:
    """An echo that keeps the lines, thread-safe, and says when one holds `text`."""

    def __init__(self):
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._said = threading.Condition(self._lock)

    def __call__(self, line: str) -> None:
        with self._said:
            self.lines.append(line)
            self._said.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        with self._said:
            assert self._said.wait_for(lambda: any(text in x for x in self.lines), timeout)


def test_a_child_relays_its_lines_with_its_label_and_returns_its_code():
    code = "import sys; print('one'); print('two', file=sys.stderr); print(); sys.exit(4)"
    echo = _Lines()
    child = Child(_python(code), {"GAGPO_PROBE": "x"}, echo, label="actor 1")
    assert child.wait(timeout=60) == 4 and child.returncode == 4 and child.poll() == 4
    child.relayed()
    assert echo.lines == ["[actor 1] one", "[actor 1] two", "[actor 1] "]  # in order, merged
    assert child.last_line == "two"  # the last one that says something
    plain = _Lines()  # no label: the lines as printed, with the environment given
    probe = Child(
        _python("import os; print(os.environ['GAGPO_PROBE'])"), {"GAGPO_PROBE": "x"}, plain
    )
    assert probe.wait(timeout=60) == 0
    probe.relayed()
    assert plain.lines == ["x"]


def test_stop_kills_a_child_that_ignores_sigterm_once_the_timeout_has_passed():
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + (
        "print('ready', flush=True); time.sleep(300)"
    )
    echo = _Lines()
    child = Child(_python(ignores), {}, echo, label="stubborn")
    echo.wait_for("ready")
    start = time.monotonic()
    assert child.stop(1.0) == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - start < 30  # SIGTERM was ignored for the whole timeout
    assert not alive(child.pid)


def test_stop_sends_the_signal_asked_for_and_returns_the_childs_own_code():
    handles = "import signal, sys, time\n" + (
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(7))\n"
        "print('ready', flush=True)\ntime.sleep(300)"
    )
    echo = _Lines()
    child = Child(_python(handles), {}, echo)
    echo.wait_for("ready")
    start = time.monotonic()
    assert child.stop(60, signal.SIGINT) == 7
    assert time.monotonic() - start < 30  # it ended on the signal, not on the timeout
    assert child.stop(60) == 7  # already ended: nothing sent, the same code
