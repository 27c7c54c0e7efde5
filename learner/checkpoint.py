"""One lineage across restarts: every published version carries its own training state.

Each update publishes the next version (docs/design.md §7: versions rise by one per
update, each the child of the one before, and no version actors may have loaded is
discarded). Just before the version's policy folder, the learner writes its state:

    learner/checkpoints/v<N>/  trainer.pt        optimiser, scheduler, RNG states (tensors and
                                                 plain types only: loaded with weights_only=True)
                               ledger.parquet    the ledger's tail as it stood after this update
                                                 (rows of compacted groups are in archive/ledger/)
                               state.json        update, version, lineage ids (see below)
                               trainable.safetensors   only when the published weights are not
                                                 the trained parameters (LoRA: the adapters)
                               .complete
    policy/v<N>/lineage.json   {"version", "parent", "update", "id", "parent_id"}

The weights are the published version's own, so the state costs the optimiser (twice
the trained parameters with AdamW) and the ledger, never a second copy of the model.
`--resume` starts from the version LATEST names, with its weights, its optimiser and its
ledger: groups of published updates stay consumed, those of a killed, unpublished update
are trained again, and the next version is LATEST + 1. Every version gets a random `id`
and records its parent's, so a checker can verify the chain (`check_lineage`).

Written with the folder protocol of `publish.py` (files, then `.complete`), state first,
then policy, then LATEST: LATEST never names a version without a complete state. Under
FSDP the optimiser state is gathered whole and keyed by parameter name; every rank takes
part in the gather, rank 0 alone writes, and every rank reads the files back.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from gagpo.learner.dist import full_optimizer_state, is_sharded, load_full_state, tied_weights
from gagpo.learner.feed import Ledger
from gagpo.learner.lease import acquire, check_lease
from gagpo.learner.publish import is_complete, publish_version, put_folder, remove_folder
from gagpo.schemas import layout
from gagpo.schemas.archive import archived_ledger
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.layout import STATE_LEDGER, STATE_RECORD, STATE_TRAINABLE, STATE_TRAINER
from gagpo.schemas.store import Store, parquet_table


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


# --- saving: every publication -------------------------------------------------------
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
) -> None:
    """Write the training state of `child` (before its policy folder). Sharded, a
    collective: every rank calls this, and only `main` (with the ledger) writes."""
    optimizer_state = full_optimizer_state(model, optimizer)
    if not main:
        return
    check_lease(store)  # a learner that lost the store's lease stops before publishing
    with tempfile.TemporaryDirectory(prefix="gagpo-state-") as tmp:
        folder = Path(tmp)
        if not _trains_everything(model):  # the published weights are merged: keep the adapters
            trained = {
                n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad
            }
            save_file(trained, str(folder / STATE_TRAINABLE))
        trainer = {
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(trainer, folder / STATE_TRAINER)
        pq.write_table(ledger.tail_table(), folder / STATE_LEDGER)
        (folder / STATE_RECORD).write_text(json.dumps(child.record(parent)))
        put_folder(store, folder, checkpoint_dir(store, child.version), phase="checkpoint")


def commit_version(
    store: Store,
    parent: Head,
    child: Head,
    model,
    optimizer,
    scheduler,
    ledger: Ledger | None,
    *,
    base_dir,
    keep_versions: int,
    keep_states: int,
    lora=None,
    main: bool = True,
    keep_every: int = 0,
) -> None:
    """State, then policy folder (with its lineage record), then LATEST, then pruning."""
    save_state(store, parent, child, model, optimizer, scheduler, ledger, main=main)
    publish_version(
        store,
        model,
        base_dir,
        child.version,
        keep_versions,
        lora,
        main=main,
        lineage=child.record(parent),
        keep_every=keep_every,
    )
    if main:
        prune_states(store, keep_states)


def state_versions(store: Store) -> list[int]:
    """Versions with a training-state folder, complete or not, ascending."""
    versions = []
    for path in store.glob(layout.checkpoint_dir(store.root, "*")):
        if (version := layout.parse_checkpoint_dir(path)) is not None:
            versions.append(version)
    return sorted(versions)


def prune_states(store: Store, keep: int) -> None:
    """Keep the states of the newest `keep` versions up to LATEST (LATEST's always)."""
    latest = store.policies.latest() or 0
    older = [v for v in state_versions(store) if v <= latest]
    for v in older[:-keep]:
        remove_folder(store, checkpoint_dir(store, v))


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
    store: Store, *, resume: bool, model, optimizer, scheduler, main: bool = True
) -> tuple[Head, Ledger]:
    """Where this run starts: version 0 with an empty ledger, or (resume) the version
    LATEST names, restored from its own weights and state. The main rank first takes the
    store's lease (learner/lease.py): one learner per store, resumed or not."""
    lease = acquire(store) if main else None
    try:
        return _start(store, resume, model, optimizer, scheduler, main)
    except BaseException:  # refused or failed: the store is free for the next learner
        if lease is not None:
            lease.release()
        raise


def _start(
    store: Store, resume: bool, model, optimizer, scheduler, main: bool
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
        head, ledger = _restore(store, latest, model, optimizer, scheduler)
    if main:
        _forget_after(store, head, ledger)
    return head, ledger


def _restore(store: Store, version: int, model, optimizer, scheduler) -> tuple[Head, Ledger]:
    remote = checkpoint_dir(store, version)
    if not is_complete(store, remote):
        raise GagpoError(
            f"policy/LATEST names v{version} but {remote} holds no complete training state, so "
            "its lineage cannot continue; accepted: a store written by this learner (or a new store)"
        )
    with tempfile.TemporaryDirectory(prefix="gagpo-resume-") as cache:
        folder = remote
        if not store.is_local:
            folder = str(Path(cache) / f"v{version}")
            store.download(remote, folder)
        folder = Path(folder)
        state = json.loads((folder / STATE_RECORD).read_text())
        published = read_lineage(store, version)
        if published.get("id") != state["id"]:
            raise GagpoError(
                f"policy v{version} (lineage id {published.get('id')}) is not the version whose "
                f"state is in {remote} (id {state['id']}); the store was altered"
            )
        if (folder / STATE_TRAINABLE).exists():
            weights = load_file(str(folder / STATE_TRAINABLE))
        else:
            weights = _published_weights(store, version, cache)
        trainer = torch.load(folder / STATE_TRAINER, weights_only=True)
        restore(model, optimizer, scheduler, weights, trainer, where=remote)
        # the tail as it stood after this update; the archive holds the compacted rows
        tail = parquet_table((folder / STATE_LEDGER).read_bytes())
        ledger = Ledger(tail, archived_ledger(store))
    return Head(state["update"], version, state["id"]), ledger


def _published_weights(store: Store, version: int, cache: str) -> dict[str, torch.Tensor]:
    folder = Path(store.policies.fetch(version, cache))
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights |= load_file(str(path))
    return weights


def restore(model, optimizer, scheduler, weights: dict, trainer: dict, *, where: str) -> None:
    """Load weights and trainer state; sharded, a collective (every rank calls it). A
    state written under either `parallel` mode resumes in either."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # optimiser order
    weights = dict(weights)
    for pair in tied_weights(model).items():  # files hold one name of each tied pair
        for a, b in (pair, pair[::-1]):
            if a in weights:
                weights.setdefault(b, weights[a])
    if is_sharded(model):
        optimizer_state = rekey_optimizer_state(trainer["optimizer"], names, by_name=True)
        missing, unexpected = load_full_state(model, optimizer, weights, optimizer_state)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(rekey_optimizer_state(trainer["optimizer"], names, by_name=False))
    required = set(names) if not _trains_everything(model) else set(model.state_dict())
    lacking = sorted(set(missing) & required - set(tied_weights(model)))
    if unexpected or lacking:
        raise GagpoError(
            f"the state in {where} does not match the model (missing {lacking[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}); accepted: a state of the same policy and LoRA settings"
        )
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
    """Undo what a killed, unpublished update left: its ledger rows, metrics and state."""
    ledger.commit(store)
    for path in store.glob(layout.metrics(store.root, "*")):
        update = layout.parse_metrics(path)  # None: a killed write's temporary, the sweep's
        if update is not None and update > head.update:
            store.remove(path)
    for v in state_versions(store):
        if v > head.version:
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
