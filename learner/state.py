"""The training state, saved every `state_every` updates off the learner's critical path
(learner/checkpoint.py reads it back on --resume).

    learner/checkpoints/v<N>/  trainer.pt        optimiser, scheduler, RNG states (tensors and
                                                 plain types only: loaded with weights_only=True)
                               optimizer-0000r-of-0000W.pt   under FSDP, instead of trainer.pt's
                                                 optimiser: rank r - 1's shard of the moments,
                                                 written by that rank (`.rank-<r>` once in)
                               ledger.parquet    the ledger's tail as it stood after this update
                                                 (rows of compacted groups are in archive/ledger/)
                               state.json        update, version, lineage ids
                               trainable.safetensors   only when the published weights are not
                                                 the trained parameters (LoRA: the adapters)
                               .complete         written last: the state is whole

The state costs the optimiser (twice the trained parameters with AdamW) and the ledger,
never a second copy of the model. It is written asynchronously (`StateWriter`): the
critical path copies it to CPU and hands the copy to a thread, which writes the files and
then `.complete`, while the next update runs; at most one state is in flight. A kill
mid-write leaves a folder without its marker, and the previous state stays in force.
LoRA runs save theirs with every version, synchronously: the adapters cannot be taken
back out of merged weights, and they are small.

Folders are written with the protocol of `publish.py` (files, then `.complete`), and a
version's state, when due, is handed over before its policy folder is written. Under
FSDP nothing is gathered: each rank copies its own shard of the optimiser state (keyed by
parameter name) and its thread writes it to its own file, then `.rank-<r>`; rank 0 writes
the rest, waits for every rank's marker, and only then commits `.complete` (storage/
sharded.py, as sharded publication does).
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from gagpo.learner.dist import is_sharded, local_optimizer_state, rank_and_world
from gagpo.learner.feed import Ledger
from gagpo.learner.lease import check_lease
from gagpo.learner.publish import Writer, commit_shard, folder_bytes, put_folder, remove_folder
from gagpo.schemas import layout
from gagpo.schemas.layout import STATE_LEDGER, STATE_RECORD, STATE_TRAINABLE, STATE_TRAINER
from gagpo.storage.folders import is_complete
from gagpo.storage.store import Store


def checkpoint_dir(store: Store, version: int) -> str:
    """The training state of published version `version`."""
    return layout.checkpoint_dir(store.root, version)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Head:
    """The newest version of the lineage: what the next update starts from."""

    update: int  # updates done (across restarts)
    version: int
    id: str | None  # lineage id of that version; None for a base policy without a record

    def child(self, update: int) -> Head:
        return Head(update, self.version + 1, uuid.uuid4().hex)

    def record(self, parent: Head) -> dict:
        return {
            "version": self.version,
            "parent": parent.version,
            "update": self.update,
            "id": self.id,
            "parent_id": parent.id,
            "published_at": time.time(),
        }


def _trains_everything(model) -> bool:
    return all(p.requires_grad for p in model.parameters())


# --- saving: every `state_every` updates --------------------------------------------
@dataclass(frozen=True)
class OptimizerShard:
    """One FSDP rank's part of a training state: its shard of the optimiser's moments."""

    rank: int
    world: int
    state: dict  # keyed by parameter name, local CPU tensors


def optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-{rank + 1:05d}-of-{world:05d}.pt"


@dataclass
class StateSnapshot:
    """A training state taken on the critical path, to be written by `write_state`. Under
    FSDP every rank has one with its `shard`; rank 0's alone has the rest (others: None)."""

    version: int
    trainer: dict | None  # optimiser (unsharded), scheduler, RNG
    trained: dict[str, torch.Tensor] | None  # the adapters, when the published weights are merged
    ledger: pa.Table | None
    record: dict
    shard: OptimizerShard | None = None


def snapshot_state(
    store: Store,
    version: int,
    record: dict,
    model,
    optimizer,
    scheduler,
    ledger: Ledger | None,
    *,
    main: bool = True,
    copy_tensors: bool = True,
) -> StateSnapshot | None:
    """The training state of `version` (its lineage `record`), detached from the live
    optimiser when `copy_tensors` (the next step changes its tensors in place while a
    thread writes the copy). Sharded, every rank calls this and gets its own shard of the
    optimiser state (a CPU copy: nothing gathered); otherwise only `main` (with the
    ledger) gets a snapshot."""
    shard = _take_shard(store, version, model, optimizer, main) if is_sharded(model) else None
    if not main:
        return StateSnapshot(version, None, None, None, record, shard) if shard else None
    check_lease(store)  # a learner that lost the store's lease stops before publishing
    optimizer_state = None
    if shard is not None:  # the moments are in the ranks' files; the groups for the record
        optimizer_state = {"param_groups": shard.state["param_groups"], "shards": shard.world}
    elif copy_tensors:
        optimizer_state = _cpu_copy(optimizer.state_dict())
    else:
        optimizer_state = optimizer.state_dict()
    trained = None
    if not _trains_everything(model):  # the published weights are merged: keep the adapters
        trained = {
            n: p.detach().to("cpu", copy=True).contiguous()
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    trainer = {
        "optimizer": optimizer_state,
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "rng": rng_state(),
    }
    return StateSnapshot(version, trainer, trained, ledger.tail_table(), record, shard)


def _take_shard(store: Store, version: int, model, optimizer, main: bool) -> OptimizerShard:
    """This rank's shard of the optimiser state, keyed by name; a collective: the main rank
    first removes an earlier attempt's folder, before any rank writes into it."""
    rank, world = rank_and_world()
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # optimiser order
    state = rekey_optimizer_state(local_optimizer_state(optimizer), names, by_name=True)
    if main:
        remove_folder(store, checkpoint_dir(store, version))
    if world > 1:
        torch.distributed.barrier()
    return OptimizerShard(rank, world, state)


def _cpu_copy(value):
    """`value` (nested dicts, lists, tuples) with every tensor copied to CPU memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(v) for v in value)
    return value


# Free bytes under which a failed torch.save is taken for a full disk (the partial file it
# left still holds the space when we look).
FULL_DISK_FREE_BYTES = 1 << 20


def save_torch(obj, path: Path) -> None:
    """torch.save, whose zip writer reports a full disk as a bare RuntimeError ("unexpected
    pos …", "file write failed") with no errno: when the disk has under
    FULL_DISK_FREE_BYTES free after it, that becomes ENOSPC naming the file, which the CLIs
    report as any full disk (one line, exit 2)."""
    try:
        with open(path, "wb") as file:  # closed on an error too: torch's own handle leaks
            torch.save(obj, file)
    except RuntimeError as exc:
        if shutil.disk_usage(path.parent).free >= FULL_DISK_FREE_BYTES:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc


def write_state(store: Store, snapshot: StateSnapshot) -> int:
    """Write `snapshot` to learner/checkpoints/v<N>/, `.complete` last; return its bytes
    (sharded: this rank's file, and on rank 0 the whole state's)."""
    if snapshot.shard is not None:
        return _write_sharded_state(store, snapshot)
    with tempfile.TemporaryDirectory(prefix="gagpo-state-") as tmp:
        folder = Path(tmp)
        if snapshot.trained is not None:
            save_file(snapshot.trained, str(folder / STATE_TRAINABLE))
        save_torch(snapshot.trainer, folder / STATE_TRAINER)
        pq.write_table(snapshot.ledger, folder / STATE_LEDGER)
        (folder / STATE_RECORD).write_text(json.dumps(snapshot.record))
        written = folder_bytes(folder)
        put_folder(store, folder, checkpoint_dir(store, snapshot.version), phase="checkpoint")
    return written


def _write_sharded_state(store: Store, snapshot: StateSnapshot) -> int:
    """FSDP: this rank's optimiser file, uploaded in parallel with the other ranks' and
    committed by the sharded-commit protocol (storage/folders.py `commit_shard`): rank 0
    also writes the trainer (no moments), ledger and record, and commits `.complete` once
    every rank's file is in, so a state missing any rank's file is never complete."""
    shard, remote = snapshot.shard, checkpoint_dir(store, snapshot.version)
    with tempfile.TemporaryDirectory(prefix="gagpo-state-") as tmp:
        folder = Path(tmp)
        save_torch(shard.state, folder / optimizer_shard_name(shard.rank, shard.world))
        if shard.rank == 0:
            save_torch(snapshot.trainer, folder / STATE_TRAINER)
            pq.write_table(snapshot.ledger, folder / STATE_LEDGER)
            (folder / STATE_RECORD).write_text(json.dumps(snapshot.record))
        files = {
            *os.listdir(folder),
            *(optimizer_shard_name(r, shard.world) for r in range(shard.world)),
        }
        return commit_shard(
            store,
            folder,
            remote,
            rank=shard.rank,
            world=shard.world,
            files=sorted(files),
            phase="checkpoint",
        )


class StateWriter(Writer):
    """Writes training states one at a time (`Writer`): in a thread (`asynchronous`)
    or at once. Each finished state then prunes to the newest `keep` (`prune`: the main
    rank's writer; under FSDP every rank has one, for its own file)."""

    def __init__(
        self, store: Store, keep: int, *, asynchronous: bool = True, prune: bool = True
    ) -> None:
        super().__init__(asynchronous=asynchronous)
        self.store, self.keep, self.prune = store, keep, prune

    def save(self, snapshot: StateSnapshot) -> None:
        self.submit(
            functools.partial(self._write, snapshot),
            name=f"gagpo-state-v{snapshot.version}",
            update=snapshot.record.get("update"),
        )

    def _write(self, snapshot: StateSnapshot) -> int:
        written = write_state(self.store, snapshot)
        if self.prune:
            prune_states(self.store, self.keep)
        return written


def state_versions(store: Store) -> list[int]:
    """Versions with a training-state folder, complete or not, ascending."""
    versions = []
    for path in store.glob(layout.checkpoint_dir(store.root, "*")):
        if (version := layout.parse_checkpoint_dir(path)) is not None:
            versions.append(version)
    return sorted(versions)


def prune_states(store: Store, keep: int) -> None:
    """Keep the newest `keep` complete states up to LATEST, and any newer one (in flight);
    a folder without its marker at or below LATEST is a killed write: removed. Called
    when no state is being written (by the writer after its write, by the learner at the
    end of a run)."""
    latest = store.policies.latest() or 0
    versions = state_versions(store)
    complete = [v for v in versions if v <= latest and is_complete(store, checkpoint_dir(store, v))]
    kept = set(complete[-keep:]) | {v for v in versions if v > latest}
    for v in versions:
        if v not in kept:
            remove_folder(store, checkpoint_dir(store, v))


def newest_state(store: Store, version: int) -> int | None:
    """The newest version at or below `version` with a complete training state."""
    for v in reversed(state_versions(store)):
        if v <= version and is_complete(store, checkpoint_dir(store, v)):
            return v
    return None


def rekey_optimizer_state(state: dict, names: list[str], *, by_name: bool) -> dict:
    """An optimiser state keyed by parameter name (FSDP's whole form) or by index
    (`optimizer.state_dict()`), whichever it is, keyed the other way if asked; `names`
    are the trainable parameters' names in the optimiser's order."""
    index = {name: i for i, name in enumerate(names)}

    def key(k: int | str) -> int | str:
        if by_name:
            return names[k] if isinstance(k, int) else k
        return index[k] if isinstance(k, str) else k

    groups = [{**g, "params": [key(p) for p in g["params"]]} for g in state["param_groups"]]
    return {"state": {key(k): v for k, v in state["state"].items()}, "param_groups": groups}
