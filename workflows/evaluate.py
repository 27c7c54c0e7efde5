"""Held-out evaluation of a run's policy versions: every version plays the same tasks.

The per-version rates of a run's own rollouts mix two things: the policy and the tasks
that happened to be drawn while that version was current. Here each evaluated version
plays the same `groups` tasks, from task seed `seed` on (far from any actor's seeds),
with the same sampling seeds, as the actors sample (the run's [actors] settings,
temperature included); the rollouts go to a scratch store and are not trained on. The
result is written to STORE/eval/heldout.parquet and printed by `gagpo run`.

Which versions exist to evaluate depends on the learner's pruning: `gagpo run` with
[run] eval_groups > 0 makes the learner keep every `eval_every`-th version
(`learner.keep_every`), so v0, vN, v2N, … and the last one are evaluated.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.actors.config import ActorConfig
from gagpo.inspection.intervals import change_line, wilson
from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.cache import policy_cache_dir
from gagpo.storage.policy_cache import VersionCache
from gagpo.storage.store import Store


def versions_to_evaluate(store: Store, every: int) -> list[int]:
    """The complete published versions that are multiples of `every`, and the newest."""

    complete = store.policies.stored()
    return sorted({v for v in complete if v % every == 0} | set(complete[-1:]))


def play(actors: ActorConfig, store: str | None = None) -> dict:
    """Roll out `actors` (a fixed `groups` job, run id "eval": reproducible sampling seeds)
    into `store`, or a scratch store; its rollouts, success rate, valid-reply rate and
    mean return. The rollouts are read back through the Store (validated, retried, any
    fsspec URL)."""
    from gagpo.actors.actor import run_actor

    with tempfile.TemporaryDirectory(prefix="gagpo-eval-") as scratch:
        url = store or scratch
        config = actors.model_copy(
            update={
                "store": url,
                "follow": False,
                "run_id": "eval",
                "groups_per_shard": actors.groups,
                "expert": False,
            }
        )
        summary = run_actor(config)
        valid, steps, total = rollout_totals(Store(url))
    return {
        "rollouts": summary.rollouts,
        "success_rate": summary.success_rate,
        "valid_rate": valid / max(steps, 1),
        "mean_return": total / max(summary.rollouts, 1),
    }


def rollout_totals(store: Store) -> tuple[int, int, float]:
    """(valid replies, steps, summed reward) over the store's committed shards."""
    from gagpo.storage.archive import read_steps_table

    table = read_steps_table(store, [C.ACTION_VALID, C.REWARD])  # archive and inbox
    valid = pc.sum(table[C.ACTION_VALID]).as_py() or 0
    total = pc.sum(table[C.REWARD]).as_py() or 0.0
    return valid, table.num_rows, total


def evaluate_version(
    store: Store, version: int, actors: ActorConfig, *, groups: int, seed: int
) -> dict:
    """Success, valid replies and mean return of `version` on the held-out tasks (a version
    of an object store is fetched into the local policy cache first)."""
    folder = store.policies.fetch(version, str(policy_cache_dir()))
    played = play(actors.model_copy(update={"policy": folder, "groups": groups, "seed": seed}))
    if line := sweep_cache(folder, version):
        print(line)
    return {"policy_version": version, **played, "task_seed": seed}


def sweep_cache(folder: str, version: int) -> str:
    """Once `version` (at `folder`) has played: the local policy cache swept as the actors
    sweep it (storage/policy_cache.py `VersionCache.sweep`: v0 and the newest two copies
    kept, cut fetches' staging folders removed), so that evaluating every kept version of
    an object store, or a chain of delta versions, leaves a bounded cache. Returns the
    sweep's line ('' when nothing went, and for a local store's own folder, read in place
    and never swept)."""
    path = Path(folder).resolve()
    if path.parent.parent != policy_cache_dir().resolve():
        return ""
    return VersionCache.at(path.parent).sweep(version).line()


def evaluate_run(
    store: Store | str, actors: ActorConfig, *, groups: int, every: int, seed: int, echo=print
) -> list[dict]:
    """Evaluate the run's kept versions on held-out tasks; write and return the rows."""
    store = store if isinstance(store, Store) else Store(store)
    rows = []
    versions = versions_to_evaluate(store, every)
    meta = {b"gagpo.eval": f"groups={groups} group_size={actors.group_size} seed={seed}".encode()}
    for i, version in enumerate(versions, 1):
        rows.append(evaluate_version(store, version, actors, groups=groups, seed=seed))
        echo(
            f"held-out evaluation: v{version} ({i}/{len(versions)}): "
            f"success {rows[-1]['success_rate']:.1%}"
        )
        # Rewritten (atomically) after every version: an evaluation stopped part-way
        # keeps the versions it finished.
        store.write_parquet(
            pa.Table.from_pylist(rows, schema=C.HELDOUT_SCHEMA), layout.heldout(store.root), meta
        )
    return rows


def _interval(row: dict) -> str:
    low, high = wilson(row["success_rate"] * row["rollouts"], row["rollouts"])
    return f"[{low:.1%}, {high:.1%}]"


def table(rows: list[dict], groups: int, group_size: int) -> str:
    """The printed held-out table, each success rate with its 95 % Wilson interval."""
    lines = [
        f"held-out evaluation: the same {groups} tasks × {group_size} rollouts for every version",
        "policy_version  rollouts  success_rate  95% interval      valid_replies  mean_return",
    ]
    for r in rows:
        lines.append(
            f"{r['policy_version']:>14}  {r['rollouts']:>8}  {r['success_rate']:>12.1%}  "
            f"{_interval(r):<16}  {r['valid_rate']:>13.1%}  {r['mean_return']:>11.3f}"
        )
    return "\n".join(lines)


def change(rows: list[dict]) -> str:
    """'held-out success: v0 a % [interval] → vN b % [interval], +x points (±y)', first to
    last evaluated version (±: the 95 % interval of the difference, inspection/intervals.py)."""
    first, last = rows[0], rows[-1]
    return (
        f"held-out success: v{first['policy_version']} {first['success_rate']:.1%} "
        f"{_interval(first)} → v{last['policy_version']} {last['success_rate']:.1%} "
        f"{_interval(last)}, "
        + change_line(
            first["success_rate"], first["rollouts"], last["success_rate"], last["rollouts"]
        )
    )
