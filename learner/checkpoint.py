"""One lineage across restarts: every published version's lineage record, and `--resume`
from the training state that learner/state.py saves every `state_every` updates.

Each update publishes the next version (docs/design.md §7: versions rise by one per
update, each the child of the one before, and no version actors may have loaded is
discarded):

    policy/v<N>/lineage.json   {"version", "parent", "update", "id", "parent_id"}

`--resume` starts from the version LATEST names (docs/design.md, "One lineage"): its own
published weights; the optimiser of the newest complete state at or before it (its
moments and step count, an approximation when that state is older than LATEST; exact
when it is LATEST's own, as with state_every = 1); the scheduler
advanced to LATEST's step; the ledger as it stood after LATEST's update. Groups of
published updates stay consumed, those of a killed, unpublished update are trained
again, and the next version is LATEST + 1. Every version gets a random `id` and records
its parent's, so a checker can verify the chain (`check_lineage`). A state sharded by
FSDP resumes on the same number of ranks, each reading (on an object store: fetching)
its own file alone; a whole state (one trainer.pt holding every moment, as an unsharded
learner writes it) resumes under either mode.

A state is data the store holds: every file of it is read as the store's own (no link,
under the root) and checked before use. A torn or hostile one (an empty trainer.pt, a
pickle, a record of the wrong shape, tensors of another model) is one line naming the
file (`TornState`); trainer.pt is loaded with weights_only=True, never otherwise.
"""

from __future__ import annotations

import json
import pickle
import tempfile
import warnings
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file

from gagpo.learner.dist import (
    is_sharded,
    load_full_state,
    load_local_optimizer_state,
    rank_and_world,
    tied_weights,
)
from gagpo.learner.feed import Ledger
from gagpo.learner.lease import acquire
from gagpo.learner.publish import remove_folder
from gagpo.learner.state import (
    Head,
    _trains_everything,
    checkpoint_dir,
    newest_state,
    optimizer_shard_name,
    rekey_optimizer_state,
    set_rng_state,
    state_versions,
)
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError, first_line
from gagpo.schemas.layout import STATE_RECORD, STATE_TRAINABLE, STATE_TRAINER
from gagpo.storage.folders import is_complete
from gagpo.storage.registry import confine_own
from gagpo.storage.store import Store


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
    """Version `version`'s lineage record ({} when it has none); one that is no record of
    ours is one line (`TornState`)."""
    path = layout.lineage(store.root, version)
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return {}
    return _record(data, path, {"version": int, "update": int, "id": str | None})


class TornState(GagpoError):
    """A training state or lineage record that --resume cannot continue from: one line
    naming its file, what is wrong with it, and what is accepted."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(
            f"{path} {why}; refused: accepted is a training state as gagpo-learner writes it "
            "(remove that state's folder to resume from an older state, or from LATEST's "
            "weights with a fresh optimiser)"
        )


RECORD_MAX_BYTES = 1 << 20  # state.json and lineage.json are a few hundred bytes


def _record(data: bytes, path: str, fields: dict) -> dict:
    """A JSON record (state.json, lineage.json) whose `fields` have their types."""
    if len(data) > RECORD_MAX_BYTES:
        raise TornState(path, f"holds {len(data)} bytes, more than a record's {RECORD_MAX_BYTES}")
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        raise TornState(path, "is no JSON (empty, or cut short)") from None
    if not isinstance(record, dict):
        raise TornState(path, "is no JSON object")
    for name, kind in fields.items():
        value = record.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TornState(path, f"has no {name!r} of type {getattr(kind, '__name__', kind)}")
        if isinstance(value, int) and value < 0:
            raise TornState(path, f"has a negative {name!r}")
    return record


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
    latest = store.policies.latest(complete=resume) or 0
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
    if head.id is None:
        raise TornState(layout.lineage(store.root, version), "has no lineage id")
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
        try:
            restore(model, optimizer, scheduler, weights, trainer, where=where)
            _check_moments(model, optimizer)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise TornState(where, f"does not fit this model and optimiser ({_why(exc)})") from None
    behind = head.update - (state["update"] if state else 0)  # updates since the state
    advance_scheduler(scheduler, behind * steps_per_update)
    # the archive holds the compacted rows; those of a killed later update are dropped
    ledger = _load_ledger(store).truncated(head.update)
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
    its update is LATEST's minus the versions between them. Only the files this rank needs
    are read (`StateFiles`): sharded, its own shard of the optimiser."""
    if found is None:
        return None, None, None
    files = StateFiles(store, checkpoint_dir(store, found), cache)
    state = _record(files.read(STATE_RECORD), files.shown(STATE_RECORD), STATE_FIELDS)
    published = read_lineage(store, found) if found in store.policies.stored() else state
    expected_update = head.update - (head.version - found)
    if published.get("id") != state["id"] or state["update"] != expected_update:
        raise GagpoError(
            f"policy v{found} (lineage id {published.get('id')}) is not the version whose "
            f"state is in {files.remote} (id {state['id']}, update {state['update']}); the "
            "store was altered"
        )
    trained = None
    if found == head.version and files.exists(STATE_TRAINABLE):
        trained = files.tensors(STATE_TRAINABLE)
    trainer = files.torch(STATE_TRAINER)
    _check_trainer(trainer, files.shown(STATE_TRAINER))
    if "shards" in trainer["optimizer"]:  # FSDP's: this rank's own file holds its moments
        trainer["optimizer"] = _read_shard(files, trainer["optimizer"]["shards"], files.remote)
    return state, trained, trainer


STATE_FIELDS = {"version": int, "update": int, "id": str}


def _load_ledger(store: Store) -> Ledger:
    """The ledger (its tail and the archive's parts); a torn file is one line naming it."""
    try:
        return Ledger.load(store)
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, pa.ArrowException):
            raise  # the store's own errors (an outage past its retries) are not a torn file
        raise TornState(layout.ledger(store.root), f"cannot be read ({_why(exc)})") from None


def _check_moments(model, optimizer) -> None:
    """Each restored moment has its parameter's shape (AdamW's load_state_dict takes any
    tensor, and the first step would fail on a foreign one). Sharded models: their local
    shards were placed by `load_local_optimizer_state` itself."""
    if is_sharded(model):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(
                        f"moment {key} of shape {tuple(value.shape)} for a parameter of shape "
                        f"{tuple(param.shape)}"
                    )


def _check_trainer(trainer: object, shown: str) -> None:
    """trainer.pt holds what `snapshot_state` writes: an optimiser state (whole, or the
    record of a sharded one), the scheduler's and the RNG's."""
    if not isinstance(trainer, dict):
        raise TornState(shown, "holds no dict of optimiser, scheduler and RNG states")
    optimizer, rng = trainer.get("optimizer"), trainer.get("rng")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list):
        raise TornState(shown, "holds no optimiser state with its parameter groups")
    shards = optimizer.get("shards")
    if shards is None and not isinstance(optimizer.get("state"), dict):
        raise TornState(shown, "holds no optimiser moments")
    if shards is not None and not (isinstance(shards, int) and 0 < shards <= 1 << 16):
        raise TornState(shown, f"names {str(shards)[:20]} optimiser shards")
    if not isinstance(trainer.get("scheduler"), dict):
        raise TornState(shown, "holds no scheduler state")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise TornState(shown, "holds no RNG state")


class StateFiles:
    """The files of the training state in the store's folder `remote`, each read as the
    store's own: on a local store in place, once `Store.confine` let it through (under the
    root, no link: neither the folder nor the file); on an object store fetched alone into
    `cache` when first read, so a rank fetches its own shard and no other rank's."""

    def __init__(self, store: Store, remote: str, cache: str) -> None:
        self.store, self.remote = store, remote
        self.cache = Path(cache) / f"state-{Path(remote).name}"
        self.fetched: list[str] = []

    def shown(self, name: str) -> str:
        return layout.join(self.remote, name)

    def exists(self, name: str) -> bool:
        return self.store.exists(self.shown(name))

    def local(self, name: str) -> Path:
        path = self.shown(name)
        if self.store.is_local:
            confine_own(self.store, [path], "reading a training state")
            if not self.store.exists(path):
                raise TornState(path, "is missing")
            return Path(path)
        dest = self.cache / name
        if name not in self.fetched:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.store.retrying(
                    f"downloading {path}", lambda: self.store.fs.get_file(path, str(dest))
                )
            except FileNotFoundError:
                raise TornState(path, "is missing") from None
            self.fetched.append(name)
        return dest

    def read(self, name: str) -> bytes:
        with open(self.local(name), "rb") as handle:
            return handle.read(RECORD_MAX_BYTES + 1)

    def torch(self, name: str):
        """A torch file, loaded with weights_only=True (tensors and plain types only)."""
        path = self.local(name)
        try:
            return torch.load(path, weights_only=True)
        except Exception as exc:  # EOFError, UnpicklingError, a torn zip: all one line
            raise TornState(self.shown(name), f"cannot be loaded ({_why(exc)})") from None

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        path = self.local(name)
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors' own errors: a torn header, a short file
            raise TornState(self.shown(name), f"cannot be loaded ({_why(exc)})") from None


def _why(exc: BaseException) -> str:
    """What is wrong, in a few words: never torch's advice to load with weights_only=False
    (a state holding more than tensors and plain types is refused, never unpickled)."""
    if isinstance(exc, EOFError):
        return "empty, or cut short"
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in str(exc):
        return "it holds objects other than tensors and plain types, never unpickled here"
    return f"{type(exc).__name__}: {first_line(exc, 160)}"


def _read_shard(files: StateFiles, world: int, remote: str) -> dict:
    """This rank's shard of a sharded optimiser state (marked "local" for `restore`); the
    world size is checked before any file is read."""
    rank, running = rank_and_world()
    if running != world:
        raise GagpoError(
            f"the optimiser state in {remote} is sharded over {world} FSDP ranks, and this "
            f"learner runs {running} process(es); accepted: --resume with parallel = fsdp "
            f"on {world} processes"
        )
    name = optimizer_shard_name(rank, world)
    state = files.torch(name)
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise TornState(files.shown(name), "holds no optimiser moments")
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
    """The weights of published version `version` (fetched: the store's own files, a
    delta applied); a torn weights file is one line naming it."""
    folder = Path(store.policies.fetch(version, cache))
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            weights |= load_file(str(path))
        except Exception as exc:  # safetensors' own errors: a torn header, a short file
            raise TornState(str(path), f"cannot be loaded ({_why(exc)})") from None
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
