"""The restart record of a `gagpo run --ray`: STORE/ray/restarts-<run id>.parquet.

The supervisor (workflows/ray_supervisor.py) notes an event per restart (an actor or the
learner started again) and per process lost for good (`replaced` false); when the run ends
they are counted in one line and written to the store, from which the run's closing line is
read back (`restarts_line`).
"""

from __future__ import annotations

import time

from gagpo.schemas import layout
from gagpo.storage.store import Store

RESTART_COLUMNS = ("process", "incarnation", "run_id", "cause", "replaced", "at")


def event(
    process: str, incarnation: int, run_id: str | None, cause: str, replaced: bool = True
) -> dict:
    """A row of the record: a restart, or a process lost for good."""
    return {
        "process": process,
        "incarnation": incarnation,
        "run_id": run_id,
        "cause": cause,
        "replaced": replaced,
        "at": time.time(),
    }


def restarts_text(events: list[dict]) -> str:
    """`ray: 1 actor restart(s), 1 learner restart(s), 0 lost (not replaced) (actor 0 ×1, …)`:
    restarts of actors and of the learner, and processes lost for good, counted apart."""
    restarted = [e for e in events if e.get("replaced", True)]
    lost = sorted(e["process"] for e in events if not e.get("replaced", True))
    learner = sum(1 for e in restarted if e["process"] == "learner")
    each: dict[str, int] = {}
    for e in restarted:
        each[e["process"]] = each.get(e["process"], 0) + 1
    details = [", ".join(f"{label} ×{n}" for label, n in sorted(each.items()))] if each else []
    if lost:
        details.append("lost: " + ", ".join(lost))
    return (
        f"ray: {len(restarted) - learner} actor restart(s), {learner} learner restart(s), "
        f"{len(lost)} lost (not replaced)" + (f" ({'; '.join(details)})" if details else "")
    )


def restarts_path(store: Store, run_id: str) -> str:
    return layout.restarts(store.root, run_id)


def write_restarts(store: Store, run_id: str, events: list[dict]) -> None:
    """One row per restart of this run, and per process lost for good; none: an empty file,
    so a run without restarts says so too. Committed atomically as every file."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("process", pa.string()),
            ("incarnation", pa.int32()),
            ("run_id", pa.string()),
            ("cause", pa.string()),
            ("replaced", pa.bool_()),
            ("at", pa.timestamp("ms", tz="UTC")),
        ]
    )
    rows = sorted(events, key=lambda e: e["at"])
    table = pa.table(
        {name: [e[name] for e in rows] for name in RESTART_COLUMNS[:-1]}
        | {"at": [int(e["at"] * 1000) for e in rows]},
        schema=schema,
    )
    store.write_parquet(
        table, restarts_path(store, run_id), {b"gagpo.launch_run_id": run_id.encode()}
    )


def restarts_line(store: Store, run_id: str) -> str:
    """The closing line of a Ray run, read back from what the run wrote to the store."""
    path = restarts_path(store, run_id)
    if not store.exists(path):
        return "ray restarts: not recorded (the run ended before its Ray actors started)"
    rows = store.read_table(path).to_pylist()
    return restarts_text(rows).replace("ray: ", "ray restarts: ", 1) + f"; recorded in {path}"
