"""One lineage across restarts: every published version's lineage record, and the training
state saved every `state_every` updates, off the learner's critical path.

Each update publishes the next version (docs/design.md §7: versions rise by one per
update, each the child of the one before, and no version actors may have loaded is
discarded). Every `state_every` updates (and at the end of a run) the learner also saves
its training state:

    learner/checkpoints/v<N>/  trainer.pt        optimiser, scheduler, RNG states (tensors and
                                                 plain types only: loaded with weights_only=True)
                               optimizer-0000r-of-0000W.pt   under FSDP, instead of trainer.pt's
                                                 optimiser: rank r - 1's shard of the moments,
                                                 written by that rank (`.rank-<r>` once in)
                               ledger.parquet    the ledger's tail as it stood after this update
                                                 (rows of compacted groups are in archive/ledger/)
                               state.json        update, version, lineage ids (see below)
                               trainable.safetensors   only when the published weights are not
                                                 the trained parameters (LoRA: the adapters)
                               .complete         written last: the state is whole
    policy/v<N>/lineage.json   {"version", "parent", "update", "id", "parent_id"}

The state costs the optimiser (twice the trained parameters with AdamW) and the ledger,
never a second copy of the model. It is written asynchronously (`StateWriter`): the
critical path copies it to CPU and hands the copy to a thread, which writes the files and
then `.complete`, while the next update runs; at most one state is in flight. A kill
mid-write leaves a folder without its marker, and the previous state stays in force.
LoRA runs save theirs with every version, synchronously: the adapters cannot be taken
back out of merged weights, and they are small.

`--resume` starts from the version LATEST names (docs/design.md, "One lineage"): its own
published weights; the optimiser of the newest complete state at or before it (its
moments and step count, an approximation when that state is older than LATEST; exact
when it is LATEST's, as in stores written before states were periodic); the scheduler
advanced to LATEST's step; the ledger as it stood after LATEST's update. Groups of
published updates stay consumed, those of a killed, unpublished update are trained
again, and the next version is LATEST + 1. Every version gets a random `id` and records
its parent's, so a checker can verify the chain (`check_lineage`).

Folders are written with the protocol of `publish.py` (files, then `.complete`), and a
version's state, when due, is handed over before its policy folder is written. Under
FSDP nothing is gathered: each rank copies its own shard of the optimiser state (keyed by
parameter name) and its thread writes it to its own file, then `.rank-<r>`; rank 0 writes
the rest, waits for every rank's marker, and only then commits `.complete` (as sharded
publication does). Such a state resumes on the same number of FSDP ranks, each reading
its own file; a whole state (written unsharded, or by FSDP before states were sharded)
resumes under either mode.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from gagpo.learner.dist import (
    is_sharded,
    load_full_state,
    load_local_optimizer_state,
    local_optimizer_state,
    rank_and_world,
    tied_weights,
)
from gagpo.learner.faults import fault_point
from gagpo.learner.feed import Ledger
from gagpo.learner.lease import acquire, check_lease
from gagpo.learner.publish import (
    Background,
    await_ranks,
    commit_marker,
    folder_bytes,
    is_complete,
    put_folder,
    rank_done,
    remove_folder,
    upload_files,
)
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, StoreFullError
from gagpo.schemas.layout import STATE_LEDGER, STATE_RECORD, STATE_TRAINABLE, STATE_TRAINER
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


def write_state(store: Store, snapshot: StateSnapshot) -> int:
    """Write `snapshot` to learner/checkpoints/v<N>/, `.complete` last; return its bytes
    (sharded: this rank's file, and on rank 0 the whole state's)."""
    if snapshot.shard is not None:
        return _write_sharded_state(store, snapshot)
    with tempfile.TemporaryDirectory(prefix="gagpo-state-") as tmp:
        folder = Path(tmp)
        if snapshot.trained is not None:
            save_file(snapshot.trained, str(folder / STATE_TRAINABLE))
        torch.save(snapshot.trainer, folder / STATE_TRAINER)
        pq.write_table(snapshot.ledger, folder / STATE_LEDGER)
        (folder / STATE_RECORD).write_text(json.dumps(snapshot.record))
        written = folder_bytes(folder)
        put_folder(store, folder, checkpoint_dir(store, snapshot.version), phase="checkpoint")
    return written


def _write_sharded_state(store: Store, snapshot: StateSnapshot) -> int:
    """FSDP: this rank's optimiser file, uploaded in parallel with the other ranks'. A rank
    other than 0 then commits `.rank-<r>` (its bytes); rank 0 writes the trainer (no
    moments), ledger and record, waits for every rank's marker, then commits `.complete`:
    a state missing any rank's file is never complete."""
    shard, remote = snapshot.shard, checkpoint_dir(store, snapshot.version)
    with tempfile.TemporaryDirectory(prefix="gagpo-state-") as tmp:
        folder = Path(tmp)
        torch.save(shard.state, folder / optimizer_shard_name(shard.rank, shard.world))
        if shard.rank != 0:
            upload_files(store, folder, remote)
            written = folder_bytes(folder)
            store.commit_bytes(rank_done(remote, shard.rank), json.dumps(written).encode())
            return written
        torch.save(snapshot.trainer, folder / STATE_TRAINER)
        pq.write_table(snapshot.ledger, folder / STATE_LEDGER)
        (folder / STATE_RECORD).write_text(json.dumps(snapshot.record))
        files = {
            *os.listdir(folder),
            *(optimizer_shard_name(r, shard.world) for r in range(shard.world)),
        }
        try:
            upload_files(store, folder, remote)
            await_ranks(store, remote, shard.world)
            fault_point("checkpoint")
            commit_marker(store, remote, sorted(files))
        except StoreFullError:
            store.remove(remote, recursive=True)
            raise
        others = sum(
            json.loads(store.read_bytes(rank_done(remote, r))) for r in range(1, shard.world)
        )
        return folder_bytes(folder) + others


def save_state(
    store: Store,
    parent: Head,
    child: Head,
    model,
    optimizer,
    scheduler,
    ledger: Ledger | None,
    *,
    main: bool = True,
) -> int:
    """Write the training state of `child` at once, on the caller's time (no copy);
    return its bytes. Sharded, a collective: every rank calls this, `main` writes."""
    record = child.record(parent)
    snapshot = snapshot_state(
        store,
        child.version,
        record,
        model,
        optimizer,
        scheduler,
        ledger,
        main=main,
        copy_tensors=False,
    )
    return write_state(store, snapshot) if snapshot is not None else 0


class StateWriter(Background):
    """Writes training states one at a time (`Background`): in a thread (`asynchronous`)
    or at once. Each finished state then prunes to the newest `keep` (`prune`: the main
    rank's writer; under FSDP every rank has one, for its own file)."""

    def __init__(
        self, store: Store, keep: int, *, asynchronous: bool = True, prune: bool = True
    ) -> None:
        super().__init__(asynchronous=asynchronous)
        self.store, self.keep, self.prune = store, keep, prune

    def save(self, snapshot: StateSnapshot) -> None:
        self.run(
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


# --- starting: fresh or --resume -----------------------------------------------------
def has_learner_state(store: Store) -> bool:
    return store.exists(layout.checkpoints_dir(store.root)) or store.exists(
        layout.ledger(store.root)
    )


def _base_head(store: Store) -> Head:
    """Version 0 (the actors' base policy); its lineage id if it has a record of its own."""
    return Head(0, 0, _own_id(read_lineage(store, 0), 0))


def _own_id(record: dict, version: int) -> str | None:
    """The id of a lineage record, if it is `version`'s (a base folder copied from a
    published version of another store may carry that version's record)."""
    return record.get("id") if record.get("version") == version else None


def read_lineage(store: Store, version: int) -> dict:
    path = layout.lineage(store.root, version)
    try:
        return json.loads(store.read_bytes(path))
    except FileNotFoundError:
        return {}


def start(
    store: Store,
    *,
    resume: bool,
    model,
    optimizer,
    scheduler,
    main: bool = True,
    steps_per_update: int = 1,
    say=None,
) -> tuple[Head, Ledger]:
    """Where this run starts: version 0 with an empty ledger, or (resume) the version
    LATEST names (`_restore`). The main rank first takes the store's lease
    (learner/lease.py): one learner per store, resumed or not. `say` gets a line when
    the optimiser state is not LATEST's own."""
    lease = acquire(store) if main else None
    try:
        return _start(store, resume, model, optimizer, scheduler, main, steps_per_update, say)
    except BaseException:  # refused or failed: the store is free for the next learner
        if lease is not None:
            lease.release()
        raise


def _start(
    store: Store, resume: bool, model, optimizer, scheduler, main: bool, steps_per_update, say
) -> tuple[Head, Ledger]:
    latest = store.policies.latest() or 0
    if not resume:  # checked by the main rank alone: it may already have announced itself
        if main and has_learner_state(store):
            raise GagpoError(
                f"store {store.url!r} already holds learner state (learner/); pass --resume to "
                "continue that run, or use another store"
            )
        if main and latest:
            raise GagpoError(
                f"store {store.url!r} has policy versions up to v{latest} but no learner state; "
                "accepted: a store whose newest policy is the base policy v0, or another store"
            )
        return _base_head(store), Ledger()
    if latest == 0:  # killed before its first publication: nothing was trained for good
        head, ledger = _base_head(store), Ledger()
    else:
        head, ledger, note = _restore(store, latest, model, optimizer, scheduler, steps_per_update)
        if note and main and say is not None:
            say(note)
    if main:
        _forget_after(store, head, ledger)
    return head, ledger


def _restore(
    store: Store, version: int, model, optimizer, scheduler, steps_per_update: int
) -> tuple[Head, Ledger, str | None]:
    """LATEST (`version`) restored: its published weights; the newest complete state at or
    before it, with the scheduler advanced by the updates since that state; the ledger as
    it stood after LATEST's update. Returns a line to show when the state is not
    LATEST's own (None when it is)."""
    published = read_lineage(store, version)
    if published.get("version") != version or not store.exists(layout.ledger(store.root)):
        raise GagpoError(
            f"policy/LATEST names v{version} but the store holds no lineage record or ledger "
            "of it, so its lineage cannot continue; accepted: a store written by this learner "
            "(or a new store)"
        )
    head = Head(published["update"], version, published["id"])
    found = newest_state(store, version)
    with tempfile.TemporaryDirectory(prefix="gagpo-resume-") as cache:
        state, trained, trainer = _read_state(store, found, head, cache)
        if trained is None and not _trains_everything(model):
            raise GagpoError(
                f"LoRA: the adapters of v{version} are in its training state, and "
                f"{checkpoint_dir(store, version)} holds no complete one; accepted: a store "
                "written by this learner"
            )
        weights = trained if trained is not None else _published_weights(store, version, cache)
        where = checkpoint_dir(store, found) if found is not None else store.policies.dir(version)
        restore(model, optimizer, scheduler, weights, trainer, where=where)
    behind = head.update - (state["update"] if state else 0)  # updates since the state
    advance_scheduler(scheduler, behind * steps_per_update)
    # the archive holds the compacted rows; those of a killed later update are dropped
    ledger = Ledger.load(store).truncated(head.update)
    if found == version:
        return head, ledger, None
    if found is None:
        note = (
            f"--resume: no complete training state at or before v{version}; v{version}'s "
            "weights continue with a fresh AdamW (docs/design.md, 'One lineage')"
        )
    else:
        note = (
            f"--resume: v{version}'s weights with the optimiser moments of v{found}, the newest "
            f"complete state ({behind} update(s) older; docs/design.md, 'One lineage')"
        )
    return head, ledger, note


def _read_state(store: Store, found: int | None, head: Head, cache: str):
    """(record, adapters or None, trainer dict or None) of state `found`, checked against
    the lineage: its id is that of the published version it names (when still kept), and
    its update is LATEST's minus the versions between them."""
    if found is None:
        return None, None, None
    remote = checkpoint_dir(store, found)
    folder = remote
    if not store.is_local:
        folder = str(Path(cache) / f"state-v{found}")
        store.download(remote, folder)
    folder = Path(folder)
    state = json.loads((folder / STATE_RECORD).read_text())
    published = read_lineage(store, found) if found in store.policies.stored() else state
    expected_update = head.update - (head.version - found)
    if published.get("id") != state["id"] or state["update"] != expected_update:
        raise GagpoError(
            f"policy v{found} (lineage id {published.get('id')}) is not the version whose "
            f"state is in {remote} (id {state['id']}, update {state['update']}); the store "
            "was altered"
        )
    trained = None
    if found == head.version and (folder / STATE_TRAINABLE).exists():
        trained = load_file(str(folder / STATE_TRAINABLE))
    trainer = torch.load(folder / STATE_TRAINER, weights_only=True)
    if "shards" in trainer["optimizer"]:  # FSDP's: this rank's own file holds its moments
        trainer["optimizer"] = _read_shard(folder, trainer["optimizer"]["shards"], remote)
    return state, trained, trainer


def _read_shard(folder: Path, world: int, remote: str) -> dict:
    """This rank's shard of a sharded optimiser state (marked "local" for `restore`)."""
    rank, running = rank_and_world()
    if running != world:
        raise GagpoError(
            f"the optimiser state in {remote} is sharded over {world} FSDP ranks, and this "
            f"learner runs {running} process(es); accepted: --resume with parallel = fsdp "
            f"on {world} processes"
        )
    state = torch.load(folder / optimizer_shard_name(rank, world), weights_only=True)
    return {**state, "local": True}


def advance_scheduler(scheduler, steps: int) -> None:
    """Move a LambdaLR `steps` optimiser steps on (to LATEST's step, from an older state's):
    its learning rate is a function of the step count alone."""
    if steps <= 0:
        return
    scheduler.last_epoch += steps - 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": no step is skipped here
        warnings.simplefilter("ignore")
        scheduler.step()


def _published_weights(store: Store, version: int, cache: str) -> dict[str, torch.Tensor]:
    folder = Path(store.policies.fetch(version, cache))
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(path))
    return weights


def restore(
    model, optimizer, scheduler, weights: dict, trainer: dict | None, *, where: str
) -> None:
    """Load weights and trainer state (None: the weights alone, a fresh optimiser);
    sharded, a collective (every rank calls it). A state written under either `parallel`
    mode resumes in either; bf16 published weights are cast to the model's dtype."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # optimiser order
    dtype = next(model.parameters()).dtype
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    for pair in tied_weights(model).items():  # files hold one name of each tied pair
        for a, b in (pair, pair[::-1]):
            if a in weights:
                weights.setdefault(b, weights[a])
    optimizer_state = trainer["optimizer"] if trainer is not None else None
    if optimizer_state is not None and optimizer_state.get("local"):
        if not is_sharded(model):  # `_read_shard` checked the world size
            raise GagpoError(
                f"the optimiser state in {where} is sharded (FSDP); accepted: --resume with "
                "parallel = fsdp on as many processes as wrote it"
            )
        missing, unexpected = load_full_state(model, optimizer, weights, None)
        local = {k: v for k, v in optimizer_state.items() if k != "local"}
        load_local_optimizer_state(optimizer, rekey_optimizer_state(local, names, by_name=False))
    elif is_sharded(model):
        if optimizer_state is not None:
            optimizer_state = rekey_optimizer_state(optimizer_state, names, by_name=True)
        missing, unexpected = load_full_state(model, optimizer, weights, optimizer_state)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if optimizer_state is not None:
            optimizer.load_state_dict(rekey_optimizer_state(optimizer_state, names, by_name=False))
    required = set(names) if not _trains_everything(model) else set(model.state_dict())
    lacking = sorted(set(missing) & required - set(tied_weights(model)))
    if unexpected or lacking:
        raise GagpoError(
            f"the state in {where} does not match the model (missing {lacking[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}); accepted: a state of the same policy and LoRA settings"
        )
    if trainer is not None:
        scheduler.load_state_dict(trainer["scheduler"])
        set_rng_state(trainer["rng"])


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


def _forget_after(store: Store, head: Head, ledger: Ledger) -> None:
    """Undo what a killed, unpublished update left: its ledger rows, metrics and state,
    and any state whose write was killed (no marker)."""
    ledger.commit(store)
    for path in store.glob(layout.metrics(store.root, "*")):
        update = layout.parse_metrics(path)  # None: a killed write's temporary, the sweep's
        if update is not None and update > head.update:
            store.remove(path)
    for v in state_versions(store):
        if v > head.version or not is_complete(store, checkpoint_dir(store, v)):
            remove_folder(store, checkpoint_dir(store, v))


# --- checking: the fault-injection script and the tests ------------------------------
def check_lineage(store: Store) -> list[str]:
    """Problems with the chain of kept versions: each version's record names the version
    before it as parent (by number and by id) and the update after its parent's. Empty:
    one sound lineage."""

    problems = []
    versions = store.policies.stored()
    records = {v: read_lineage(store, v) for v in versions}
    for v in versions:
        record, parent = records[v], records.get(v - 1)
        if v == 0:
            continue
        if record.get("version") != v or record.get("parent") != v - 1:
            problems.append(f"v{v}: lineage record {record} does not name parent v{v - 1}")
        elif parent is None:  # pruned: nothing to compare with
            continue
        elif record.get("parent_id") != _own_id(parent, v - 1):
            problems.append(f"v{v}: parent id {record.get('parent_id')} is not v{v - 1}'s")
        elif record.get("update") != (parent.get("update", 0) if v > 1 else 0) + 1:
            problems.append(f"v{v}: update {record.get('update')} does not follow v{v - 1}'s")
    return problems
