"""Publication of policy versions.

A version's folder is written by the folder protocol of storage/folders.py (its files,
then `.complete`; under FSDP the sharded commit), and only then is `policy/LATEST` moved
to it: a reader that follows LATEST always finds a complete folder, on a local disk as on
an object store, whatever instant the writer was killed at. A folder without its marker
is a crashed attempt: it is removed before being rewritten.

    policy/v<N>/  config.json, model.safetensors, generation_config.json, tokenizer files
                  (copied from the base folder), lineage.json, .complete — loadable by
                  transformers and vLLM as is; the weights in the learner's `publish_dtype`
                  (bf16 when it trains in bf16: what actors serve), config.json naming it
    policy/v<N>/  adapter_config.json, adapter_model.safetensors (+ tokenizer) with LoRA
                  `publish = "adapter"`: a PEFT-format adapter of the base model
    policy/v<N>/  under FSDP: model-0000r-of-0000N.safetensors written by rank r - 1 (the
                  tensors it owns), model.safetensors.index.json and the rest by rank 0,
                  .rank-<r> once rank r's file is in, then .complete (`write_shard`)

The learner publishes full weights through `Publisher`: the critical path copies the
weights (in the published dtype) and a thread (storage/background.py) writes the folder,
commits the marker, then moves LATEST, one version at a time, while the next update runs;
`close` ends a run. A LoRA adapter (`publish = "adapter"`) is written at once
(`write_version`), then pointed at (`point_latest`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gagpo.learner.faults import fault_point
from gagpo.learner.lease import check_lease
from gagpo.schemas.layout import LINEAGE
from gagpo.storage import folders
from gagpo.storage.background import Background
from gagpo.storage.delta import DeltaPublisher
from gagpo.storage.faults import set_thread_ordinal
from gagpo.storage.folders import folder_bytes, remove_folder
from gagpo.storage.store import Store

if TYPE_CHECKING:
    import torch

# Files of a model folder that describe weights; everything else (tokenizer, chat
# template, ...) is copied from the base folder into every version.
_WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.gguf|\.pt|\.pth|\.index\.json)$|^config\.json$")


def put_folder(store: Store, local_dir: str | Path, remote_dir: str, *, phase: str) -> None:
    """storage/folders.py `put_folder`, held at this module's `fault_point` (crash tests
    replace it to cut a publication or a state between its files and its marker)."""
    folders.put_folder(store, local_dir, remote_dir, phase=phase, fault=_hold)


def commit_shard(store: Store, local_dir: Path, remote: str, **protocol) -> int:
    """storage/folders.py `commit_shard` (the sharded commit), held as `put_folder` is."""
    return folders.commit_shard(store, local_dir, remote, fault=_hold, **protocol)


def _hold(phase: str) -> None:
    fault_point(phase)  # looked up at each call: the crash tests' replacement applies


def copy_tokenizer_files(base_dir: Path, dest: Path) -> None:
    for path in sorted(Path(base_dir).iterdir()):
        if path.name == LINEAGE:  # a base folder that was once a published version
            continue
        if path.is_file() and not path.name.startswith(".") and not _WEIGHT_FILES.search(path.name):
            shutil.copy2(path, dest / path.name)


def prune_versions(store: Store, keep: int, every: int = 0) -> list[int]:
    """Delete all but the newest `keep` complete versions (never LATEST's, nor, with
    `every` > 0, the multiples of `every`: kept for evaluation later); return them."""
    latest = store.policies.latest()
    versions = store.policies.folders()
    complete = store.policies.stored()
    # v0 is the base policy the actors published: learners (and --resume) start from it.
    kept = set(complete[-keep:]) | ({latest} if latest is not None else set()) | {0}
    kept |= {v for v in complete if every and v % every == 0}
    kept = store.policies.needed_by(kept)  # the bases a kept delta version is applied to
    newest_kept = max(kept, default=-1)
    # Incomplete folders newer than every kept version may be a publication in flight.
    doomed = [v for v in versions if v not in kept and v < newest_kept]
    for v in doomed:
        remove_folder(store, store.policies.dir(v))
    return doomed


def write_version(
    store: Store,
    model,
    base_dir: Path,
    version: int,
    lora,
    *,
    main: bool = True,
    lineage: dict | None = None,
) -> int:
    """Write policy `version` as a PEFT adapter of the base model (`lora.publish =
    "adapter"`, with the tokenizer files of `base_dir` and its `lineage` record) at once,
    not yet pointed at (`point_latest`); return the bytes written (0 on ranks other than
    `main`). Full weights, merged LoRA ones included, go through `Publisher` instead."""
    if not main:
        return 0
    with tempfile.TemporaryDirectory(prefix="gagpo-publish-") as tmp:
        folder = Path(tmp)
        copy_tokenizer_files(base_dir, folder)
        write_adapter(model, folder, base_dir, lora)
        return _put_version(store, folder, version, lineage)


@dataclass
class VersionCopy:
    """A policy version's weights taken on the critical path, to be written later."""

    version: int
    update: int  # the update that made it (crash tests hold "publish:<update>")
    weights: dict[str, torch.Tensor] | None  # whole, in the published dtype; None: the model's
    lineage: dict | None
    dtype: torch.dtype | None  # None: the master weights' own
    shards: Shards | None = None  # FSDP: this rank's file of a sharded folder


@dataclass(frozen=True)
class Shards:
    """Who writes what of a sharded version (FSDP): rank r writes the tensors it owns to
    `shard_name(r, world)`; rank 0 also writes the rest of the folder and its index."""

    rank: int
    world: int
    owners: dict[str, tuple[int, int]]  # tensor name → (owner rank, bytes as published)


def shard_name(rank: int, world: int) -> str:
    """transformers' name for file `rank` of a sharded checkpoint."""
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def take_weights(
    model, *, main: bool = True, dtype: torch.dtype | None = None, copy: bool = True
) -> dict[str, torch.Tensor] | None:
    """The weights to publish, as whole tensors in `dtype` (None: the model's own) on CPU;
    with `copy`, none of them shares memory with the live parameters (the next step
    changes those in place while a thread writes the copy). A LoRA model gives its
    merged weights. None when there is nothing to cast, copy or merge (written at once
    from the model itself). Sharded (FSDP), a collective: every rank calls this, `main`
    gets the tensors, the other ranks None."""
    from gagpo.learner.dist import full_model_state, is_sharded
    from gagpo.learner.model import lora_modules, merged_state_dict

    sharded = is_sharded(model)
    state = full_model_state(model) if sharded else None  # FSDP: no LoRA (config)
    if not main:
        return None
    if lora_modules(model):
        state = merged_state_dict(model)
    if state is None and dtype is None and not copy:
        return None  # written at once, as they are: `save_pretrained` takes the model's own
    state = model.state_dict() if state is None else state
    # A gathered state is already a CPU copy of its own; cast or copy the rest.
    return detached_copy(state, dtype, copy=copy and not sharded)


def write_weights(
    store: Store, model, base_dir: Path, version: VersionCopy, delta: DeltaPublisher | None = None
) -> int:
    """Write the folder of `version` (HF format, the tokenizer files of `base_dir`) and its
    marker; return its bytes. `model` lends only its config and file layout: the tensors
    are `version.weights`, so this may run in a thread while the model trains on. With
    `delta`, a bf16 version is written as a delta of the previous one when due."""
    with tempfile.TemporaryDirectory(prefix="gagpo-publish-") as tmp:
        folder = Path(tmp)
        copy_tokenizer_files(base_dir, folder)
        model.save_pretrained(folder, state_dict=version.weights)
        if version.dtype is not None:
            _declare_dtype(folder, version.dtype)
        if delta is not None and getattr(version.dtype, "itemsize", 4) == 2:  # bf16 bits
            delta.encode(folder, version.version)
        return _put_version(store, folder, version.version, version.lineage)


def write_shard(store: Store, model, base_dir: Path, version: VersionCopy) -> int:
    """FSDP: this rank's file of the sharded folder of `version`, uploaded in parallel with
    the other ranks' (each holds only its own tensors: no whole-model gather), committed by
    the sharded-commit protocol (storage/folders.py `commit_shard`): rank 0 also writes
    config.json (the model's own class, the published dtype),
    `model.safetensors.index.json`, the tokenizer files and the lineage, and commits
    `.complete` once every rank's file is in. The folder loads as it is in transformers
    and vLLM. Returns the bytes written (rank 0: the whole folder's)."""
    from safetensors.torch import save_file

    shards = version.shards
    remote = store.policies.dir(version.version)
    with tempfile.TemporaryDirectory(prefix="gagpo-publish-") as tmp:
        folder = Path(tmp)
        mine = folder / shard_name(shards.rank, shards.world)
        save_file(version.weights, str(mine), metadata={"format": "pt"})
        if shards.rank == 0:
            copy_tokenizer_files(base_dir, folder)
            _write_config(model, folder, version.dtype)
            owners = sorted(shards.owners.items())
            weight_map = {n: shard_name(o, shards.world) for n, (o, _) in owners}
            total = sum(size for _, size in shards.owners.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            if version.lineage is not None:
                (folder / LINEAGE).write_text(json.dumps(version.lineage))
        files = {*os.listdir(folder), *(shard_name(r, shards.world) for r in range(shards.world))}
        return commit_shard(
            store,
            folder,
            remote,
            rank=shards.rank,
            world=shards.world,
            files=sorted(files),
            phase="publish",
        )


SHARD_INDEX = "model.safetensors.index.json"


def _write_config(model, folder: Path, dtype: torch.dtype | None) -> None:
    """config.json (naming the model's own class, not FSDP's wrapper) and
    generation_config.json, as `save_pretrained` writes them."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    own = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = copy.deepcopy(model.config)
    config.architectures = [own.__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    _declare_dtype(folder, dtype or next(model.parameters()).dtype)


def _put_version(store: Store, folder: Path, version: int, lineage: dict | None) -> int:
    if lineage is not None:
        (folder / LINEAGE).write_text(json.dumps(lineage))
    written = folder_bytes(folder)
    put_folder(store, folder, store.policies.dir(version), phase="publish")
    return written


def point_latest(store: Store, version: int, keep: int, keep_every: int = 0) -> None:
    """Point LATEST at the complete folder of `version`, then prune (`prune_versions`)."""
    check_lease(store)  # a learner that lost the store's lease never moves LATEST
    store.policies.set_latest(version)
    prune_versions(store, keep, keep_every)


def detached_copy(state: dict, dtype: torch.dtype | None, *, copy: bool = True) -> dict:
    """Floating tensors of `state` cast to `dtype` (None: kept) on CPU; with `copy`, every
    tensor is a copy of its own even when nothing is cast. Tensors that share storage (tied
    embeddings) stay shared, so `save_pretrained` still writes them once."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        cast = tensor.is_floating_point() and dtype is not None and tensor.dtype != dtype
        if not (cast or copy):
            out[name] = tensor
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in done:
            wanted = dtype if cast else tensor.dtype
            done[key] = tensor.detach().to("cpu", wanted, copy=True)
        out[name] = done[key]
    return out


def _declare_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype of the files (`save_pretrained` writes the model's own):
    loaders with dtype "auto" (vLLM, transformers) then take the published dtype."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    if not {"dtype", "torch_dtype"} & config.keys():
        config["dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_adapter(model, folder: Path, base_dir: Path, lora) -> None:
    """A standard PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), as
    `PeftModel.save_pretrained` writes it: `PeftModel.from_pretrained(base, folder)` and
    vLLM's `LoRARequest(name, id, folder)` load it as it is."""
    from safetensors.torch import save_file

    from gagpo.learner.model import adapter_state_dict, lora_config

    tensors = adapter_state_dict(model)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = lora_config(lora.rank, lora.alpha, lora.target_modules, lora.dropout, str(base_dir))
    config.inference_mode = True
    config.save_pretrained(str(folder))


# --- writing off the critical path ----------------------------------------------------
class Writer(Background):
    """Writes one folder at a time (storage/background.py): in a thread (`asynchronous`)
    or at once on the caller's. Not a daemon: a learner that stops on an error still
    finishes what it began. A job's fault points count as its `update`'s, whatever
    update runs meanwhile; each job returns the bytes it wrote, summed until
    `take_bytes`."""

    def __init__(self, *, asynchronous: bool = True) -> None:
        super().__init__(asynchronous=asynchronous)
        self._lock = threading.Lock()
        self._bytes = 0  # written by finished jobs, not yet taken by a metrics row

    def submit(self, job: Callable[[], int], *, name: str, update: int | None = None) -> None:
        """Run `job` after the one in flight (storage/background.py `Background.submit`)."""
        super().submit(functools.partial(self._count, job, update), name=name)

    def _count(self, job: Callable[[], int], update: int | None) -> int:
        if update is not None and self.asynchronous:  # the caller's thread keeps its own
            set_thread_ordinal(update)  # crash tests hold "<phase>:N" in update N's job
        written = job()
        with self._lock:
            self._bytes += written
        return written

    def take_bytes(self) -> int:
        """Bytes of the jobs finished since the last call."""
        with self._lock:
            taken, self._bytes = self._bytes, 0
        return taken


class Publisher(Writer):
    """Publishes policy versions in order, at most one in flight: the thread writes the
    version's folder, commits its marker, then points LATEST at it and prunes. LATEST
    therefore only ever moves to a complete folder, and a kill while a version is in
    flight leaves LATEST at the one before."""

    def __init__(
        self,
        store: Store,
        model,
        base_dir: Path,
        keep: int,
        keep_every: int = 0,
        *,
        asynchronous: bool = True,
        delta_every: int = 0,
    ) -> None:
        super().__init__(asynchronous=asynchronous)
        self.store, self.model, self.base_dir = store, model, base_dir
        self.keep, self.keep_every = keep, keep_every
        self.delta = DeltaPublisher(delta_every, keep_every) if delta_every else None

    def publish(self, version: VersionCopy) -> None:
        """Hand `version` to the thread (after the one in flight): written, then LATEST."""
        self.submit(
            functools.partial(self._publish, version),
            name=f"gagpo-publish-v{version.version}",
            update=version.update,
        )

    def write(self, version: VersionCopy) -> int:
        """Write the folder of `version` at once, on the caller's time, not pointed at (a
        sharded version: this rank's part of it)."""
        if version.shards is not None:
            return write_shard(self.store, self.model, self.base_dir, version)
        return write_weights(self.store, self.model, self.base_dir, version, self.delta)

    def _publish(self, version: VersionCopy) -> int:
        written = self.write(version)
        if version.shards is None or version.shards.rank == 0:
            point_latest(self.store, version.version, self.keep, self.keep_every)
        return written

    def close(self) -> None:
        """The end of a run: wait for the version in flight (its error raised here), then
        drop the previous version's weights files held for the next delta (a full copy of
        the model on the local disk)."""
        try:
            super().close()
        finally:
            if self.delta is not None:
                self.delta.close()
