"""Progress on long commands: counts and time left, and labelled lines under `gagpo run`."""

from __future__ import annotations

import sys
import threading

from gagpo.pipeline.config import parse_estimator_config
from gagpo.pipeline.recompute import recompute_store
from gagpo.storage.store import Store
from tests.helpers.steps import make_steps


def test_run_relays_each_process_with_its_label():
    from gagpo.workflows.child import Child

    lines: list[str] = []
    lock = threading.Lock()

    def echo(line: str) -> None:
        with lock:
            lines.append(line)

    code = "import sys; print('one'); print('two', file=sys.stderr)"
    proc = Child([sys.executable, "-c", code], {}, echo, label="actor 1")
    assert proc.wait(timeout=60) == 0
    for _ in range(100):  # the relay thread drains the pipe after the exit
        if len(lines) == 2:
            break
        threading.Event().wait(0.05)
    assert sorted(lines) == ["[actor 1] one", "[actor 1] two"]


def test_advantages_over_a_store_report_shards_done_of_total(tmp_path):
    store = Store(str(tmp_path / "store"))
    for k in range(3):
        store.write_shard(make_steps(shard_id=f"s{k}", groups=1, group_size=2), group_size=2)
    calls: list[tuple[int, int]] = []
    summary = recompute_store(
        store.url, None, parse_estimator_config({}), progress=lambda d, n: calls.append((d, n))
    )
    assert summary.shards == 3
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_actor_progress_counts_from_the_loaded_policy_with_time_left(capsys):
    from types import SimpleNamespace

    from gagpo.actors.cli import _progress_printer

    progress, update = _progress_printer(10)  # not a terminal here: plain lines
    summary = SimpleNamespace(
        groups=2,
        steps=40,
        steps_per_second=4.0,
        success_rate=0.5,
        versions={0, 1},
        seconds_throttled=0.0,
        seconds_total=10.0,
    )
    with progress:
        update(summary)
    err = capsys.readouterr().err
    assert "groups 2/10" in err and "0:10 elapsed, ETA 0:40" in err
