"""Several learner processes under torchrun: data parallel with one reader of the store.

Rank 0 alone talks to the store (feed, ledger, metrics, checkpoints, publication) and
broadcasts each batch as Arrow IPC bytes (no pickling). Every rank scores its share of
the micro-batches. With `parallel = "ddp"`, every rank holds the whole model and the
gradients are summed with one all-reduce per optimiser step — the same arithmetic as DDP,
without requiring equal micro-batch counts per rank. With `parallel = "fsdp"`, FSDP2
(`fully_shard`) shards parameters, gradients and optimiser state: one unit per decoder
layer plus the root. Its collectives run in every forward and backward, so the ranks pad
their micro-batch lists to equal length (see `update.run_update`). A published version is
written in parallel, each rank its own file with the tensors it owns (`owned_weights`:
no whole-model gather); so is the optimiser state, each rank its own shard of the moments
(`local_optimizer_state`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.distributed as tdist

from gagpo.schemas.config import gpu_memory_share
from gagpo.schemas.errors import GagpoError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise GagpoError(f"device {spec!r} asked for, but no CUDA device is visible; accepted: cpu")
    if spec == "cuda":
        spec = f"cuda:{local_rank}"
    device = torch.device(spec)
    share = gpu_memory_share()  # set by `gagpo run` on a GPU it shares (workflows/layout.py)
    if device.type == "cuda" and share is not None and share < 1.0:
        torch.cuda.set_per_process_memory_fraction(share, device)
    return device


def init_dist(device: str) -> Dist:
    """The process's place in a torchrun job (world 1 when started directly)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = pick_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not tdist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def close_dist(d: Dist) -> None:
    if d.world > 1 and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


def broadcast_table(table: pa.Table | None, d: Dist) -> pa.Table | None:
    """Rank 0's table (None = stop) on every rank."""
    if d.world == 1:
        return table
    payload = b""
    if d.main and table is not None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=d.comm_device)
    tdist.broadcast(size, 0)
    if int(size) == 0:
        return None
    buffer = torch.empty(int(size), dtype=torch.uint8, device=d.comm_device)
    if d.main:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    tdist.broadcast(buffer, 0)
    return pa.ipc.open_stream(pa.py_buffer(buffer.cpu().numpy().tobytes())).read_all()


def all_reduce_grads(params: list[torch.nn.Parameter], d: Dist) -> None:
    """Sum the gradients of every rank (each rank's loss already carries its global weight)."""
    if d.world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    tdist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def shard_model(model: torch.nn.Module, precision: str = "fp32") -> None:
    """FSDP2 in place: each decoder layer (the model's `_no_split_modules`) is one unit,
    the root holds the rest (embeddings, final norm, head). With `precision = "bf16"`
    every unit gathers its parameters in bf16 and reduces gradients in fp32 (the sharded
    master weights stay fp32; see `precision.py`)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from gagpo.learner.precision import fsdp_mixed_precision

    policy = fsdp_mixed_precision(precision)
    options = {"mp_policy": policy} if policy is not None else {}

    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise GagpoError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules); "
            "accepted with fsdp: Hugging Face causal LMs (Llama, Qwen, ...), or parallel = ddp"
        )
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # Sum, not average: each rank's loss already carries its global weight, as
            # in `all_reduce_grads`. Plain SUM because gloo has no PREMUL_SUM.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm and return it (a plain tensor, also under FSDP)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Gathered whole onto CPU; with a process group, only rank 0 keeps the tensors.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def tied_weights(model: torch.nn.Module) -> dict[str, str]:
    """{tied name: source name} as transformers declares them (lm_head ← embed_tokens)."""
    tied = getattr(model, "_tied_weights_keys", None)
    return dict(tied) if isinstance(tied, dict) else {}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a whole tensor, as `model.state_dict()` gives them.

    Sharded, this is a collective: every rank calls it; rank 0 gets the tensors (on CPU),
    the others an empty dict. Tied weights come back as one tensor under both names, so
    `save_pretrained` writes the same files as for an unsharded model."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full_options())
    for name, source in tied_weights(model).items():
        if name in state and source in state:
            state[name] = state[source]
    return state


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of a sharded model's `optimizer.state_dict()`, copied to CPU:
    each moment (a DTensor sharded as its parameter) becomes the local shard this rank
    holds. No collective: nothing is gathered, so each rank saves its own share."""
    from torch.distributed.tensor import DTensor

    def local(value):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        return value

    state = optimizer.state_dict()
    moments = {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}
    return {"state": moments, "param_groups": state["param_groups"]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of `local_optimizer_state` on the same ranks: each local shard (keyed by
    index) is made a DTensor laid out as its parameter is, then loaded."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def placed(value, param):
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
            return value
        if value.dim() == 0 or value.shape != param.to_local().shape:
            return value  # AdamW's step count: a plain scalar, as it was saved
        return DTensor.from_local(
            value.to(param.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    moments = {
        i: {k: placed(v, params[i]) for k, v in s.items()} for i, s in state["state"].items()
    }
    optimizer.load_state_dict({"state": moments, "param_groups": state["param_groups"]})


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's size ((0, 1) without a process group)."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict | None):
    """Sharded counterpart of `load_state_dict` for both (the model alone when
    `optimizer_state` is None): every rank passes the whole state and keeps its shards.
    Returns the model's (missing, unexpected) keys."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    keys = set_model_state_dict(model, model_state, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
    return keys.missing_keys, keys.unexpected_keys


def all_reduce(values: torch.Tensor, d: Dist, op: str = "sum") -> torch.Tensor:
    if d.world == 1:
        return values
    values = values.to(d.comm_device)
    tdist.all_reduce(values, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
    return values.cpu()


def owned_weights(
    model: torch.nn.Module, d: Dist, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """A sharded model's parameters and buffers split among the ranks for publication:
    each tensor has one owner (whole tensors, balanced by bytes), which alone keeps it,
    whole, on CPU and cast to `dtype`. A collective: every rank gathers each tensor in
    turn (`full_tensor`) and drops those it does not own, so no rank holds more than its
    share plus one tensor: no whole-model gather. Returns this rank's tensors and, for
    every name, (owner, bytes as published). A tied weight appears once, under its
    first name (`save_pretrained` writes it so)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    # A tied pair is one parameter: named_parameters gives it once, under its first name.
    unique = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    names = [n for n in state if n in unique]

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    sizes = {n: state[n].numel() * out_dtype(state[n]).itemsize for n in names}
    load = [0] * d.world
    layout: dict[str, tuple[int, int]] = {}
    for name in sorted(names, key=lambda n: (-sizes[n], n)):  # largest first, to the least loaded
        owner = min(range(d.world), key=lambda r: (load[r], r))
        load[owner] += sizes[name]
        layout[name] = (owner, sizes[name])
    mine = {}
    for name in names:  # the same order on every rank: the gathers pair up
        tensor = state[name]
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if layout[name][0] == d.rank:
            mine[name] = whole.detach().to("cpu", out_dtype(whole), copy=True).contiguous()
        del whole
    return mine, {n: layout[n] for n in names}


def barrier(d: Dist) -> None:
    if d.world > 1:
        tdist.barrier()
