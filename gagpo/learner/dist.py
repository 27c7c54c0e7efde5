"""Several learner processes under torchrun: data parallel with one reader of the store.

Rank 0 alone talks to the store (feed, ledger, metrics, checkpoints, publication) and
broadcasts each batch as Arrow IPC bytes (no pickling). Every rank scores its share of
the micro-batches; gradients are summed with one all-reduce per optimiser step — the
same arithmetic as DDP, without requiring equal micro-batch counts per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.distributed as tdist

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
    return torch.device(spec)


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


def all_reduce(values: torch.Tensor, d: Dist, op: str = "sum") -> torch.Tensor:
    if d.world == 1:
        return values
    values = values.to(d.comm_device)
    tdist.all_reduce(values, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
    return values.cpu()
