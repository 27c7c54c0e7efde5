"""FSDP (`parallel = "fsdp"`): torchrun with 2 CPU processes (gloo) against one process,
through a checkpoint and --resume; the optimiser-state re-keying between the two
checkpoint forms; the configuration rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from pydantic import ValidationError

from gagpo.learner.config import LearnerConfig
from gagpo.learner.feed import TRAINED, Ledger
from gagpo.learner.metrics import read_metrics
from gagpo.learner.state import checkpoint_dir, rekey_optimizer_state
from gagpo.storage.store import Store
from tests.helpers.learner import (
    ENV,
    ROOT,
    learner_args,
    parameters,
    run_learner,
    run_torchrun,
    tiny_model_dir,
    write_shards,
)


@pytest.mark.slow
def test_fsdp_two_processes_match_one_across_resume(tmp_path):
    """FSDP on 2 processes stops after update 2 (its state sharded, one file per rank) and
    resumes for update 3; one unsharded process runs the 3 updates on the same data. Each rank pads its micro-batch
    list with zero-weight passes and FSDP sums the gradients, so only the float summation
    order differs: published parameters and the final checkpoint agree to 1e-5 absolute
    (measured: below 1e-6), and every group is trained exactly once."""
    stores = {}
    for name in ("one", "fsdp"):
        stores[name] = Store(str(tmp_path / name))
        write_shards(stores[name], 3, groups=3)
    extra = ("--mini-batches", "2")  # two steps per update
    single = run_learner(*learner_args(tmp_path / "one", *extra))
    assert single.returncode == 0, single.stderr
    fsdp = (*extra, "--parallel", "fsdp")
    first = run_torchrun(*learner_args(tmp_path / "fsdp", *fsdp, "--updates", "2"))
    assert first.returncode == 0, first.stderr[-8000:]
    assert stores["fsdp"].policies.latest() == 2
    resumed = run_torchrun(*learner_args(tmp_path / "fsdp", *fsdp, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-8000:]

    base = parameters(tiny_model_dir())
    for version in (2, 3):
        a = parameters(stores["one"].policies.dir(version))
        b = parameters(stores["fsdp"].policies.dir(version))
        assert a.keys() == b.keys()  # tied lm_head not written twice
        assert any(not np.array_equal(a[k], base[k]) for k in a)
        for name in a:
            np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0, err_msg=name)
    config = json.loads((tmp_path / "fsdp" / "policy" / "v3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not the FSDP wrapper class
    # v3's training state: the AdamW moments agree too (keyed by index or by name).
    a, b = (_moments(checkpoint_dir(stores[n], 3)) for n in ("one", "fsdp"))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    for version in (2, 3):  # v2's state was resumed from: each rank wrote its own half
        _assert_sharded_state(checkpoint_dir(stores["fsdp"], version))

    m1, m2 = read_metrics(stores["one"]), read_metrics(stores["fsdp"])
    np.testing.assert_allclose(m1["loss"].to_numpy(), m2["loss"].to_numpy(), atol=1e-5)
    assert m1["actions"].to_list() == m2["actions"].to_list()
    ledger = pl.from_arrow(Ledger.load(stores["fsdp"]).table())
    assert ledger["status"].to_list() == [TRAINED] * 9
    assert ledger["update"].to_list() == sorted(ledger["update"].to_list())
    _whole_state_resumes_under_fsdp(tmp_path, extra)


def _whole_state_resumes_under_fsdp(tmp_path, extra) -> None:
    """A store whose state is whole (one process wrote it, as FSDP did before states were
    sharded) resumes under FSDP on 2 ranks: its update 4 equals the same store resumed
    by one process, within the same tolerance."""
    shutil.copytree(tmp_path / "one", tmp_path / "whole")
    for name in ("one", "whole"):
        write_shards(Store(str(tmp_path / name)), 1, groups=3, prefix="t")
    more = (*extra, "--updates", "4", "--resume")
    single = run_learner(*learner_args(tmp_path / "one", *more))
    assert single.returncode == 0, single.stderr[-4000:]
    fsdp = run_torchrun(*learner_args(tmp_path / "whole", *more, "--parallel", "fsdp"))
    assert fsdp.returncode == 0, fsdp.stderr[-8000:]
    assert "optimiser moments of" not in fsdp.stderr and "fresh AdamW" not in fsdp.stderr
    a = parameters(Store(str(tmp_path / "one")).policies.dir(4))
    b = parameters(Store(str(tmp_path / "whole")).policies.dir(4))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, rtol=0, err_msg=name)
    _assert_sharded_state(checkpoint_dir(Store(str(tmp_path / "whole")), 4))


@pytest.mark.slow
def test_fsdp_kill_during_a_sharded_state_write_then_resume(tmp_path):
    """Rank 0's state thread held inside v2's sharded state (every rank's file in, no
    marker yet), then rank 0 SIGKILLed (torchrun stops rank 1): that state never counts,
    and --resume on 2 ranks continues one lineage from LATEST, every group trained once,
    every state kept complete and sharded."""
    import os
    import signal
    import time

    from gagpo.learner.checkpoint import check_lineage
    from gagpo.learner.state import state_versions

    root = tmp_path / "store"
    store = Store(str(root))
    write_shards(store, 3, groups=3)
    held, args = tmp_path / "held", ("--parallel", "fsdp", "--state-every", "1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [
        *torchrun,
        "--nproc-per-node",
        "2",
        "-m",
        "gagpo.learner.cli",
        *learner_args(root, *args),
    ]
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**ENV, "GAGPO_LEARNER_HOLD": f"checkpoint:2:{held}"},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 240
            while not held.exists() or not held.read_text():
                assert proc.poll() is None, (tmp_path / "stderr").read_text()[-4000:]
                assert time.monotonic() < deadline, "rank 0 never reached the hold point"
                time.sleep(0.05)
            torn = Path(checkpoint_dir(store, 2))
            assert (torn / ".rank-1").exists() and not (torn / ".complete").exists()
            os.kill(int(held.read_text()), signal.SIGKILL)  # rank 0, mid-write
        finally:
            proc.wait(timeout=120)
    latest = store.policies.latest()
    assert latest in (1, 2)
    resumed = run_torchrun(*learner_args(root, *args, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-8000:]
    assert ("optimiser moments of v1" in resumed.stderr) == (latest == 2)
    assert store.policies.latest() == 3 and check_lineage(store) == []
    ledger = pl.from_arrow(Ledger.load(store).table())
    assert ledger["status"].to_list() == [TRAINED] * 9 and ledger["group_id"].n_unique() == 9
    kept = state_versions(store)
    assert kept and kept[-1] == 3
    for version in kept:
        _assert_sharded_state(checkpoint_dir(store, version))


def _moments(folder) -> np.ndarray:
    """Per parameter and moment, the sum of absolute values: of the whole state, or of
    the ranks' shards added up (FSDP)."""
    import torch

    trainer = torch.load(f"{folder}/trainer.pt", weights_only=True)
    parts = [trainer["optimizer"]]
    if "shards" in trainer["optimizer"]:
        parts = [torch.load(f, weights_only=True) for f in sorted(Path(folder).glob("optimizer-*"))]
    sums: dict = {}
    for part in parts:
        for name, moments in part["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                sums[name, k] = sums.get((name, k), 0.0) + float(moments[k].abs().sum())
    return np.sort(list(sums.values()))


def _assert_sharded_state(folder) -> None:
    """An FSDP state: no moments in trainer.pt, one optimiser file per rank, each holding
    its own shard of every moment (about half the elements: no whole gather on rank 0),
    the two together as many as the parameters."""
    import torch

    from gagpo.learner.model import load_model

    trainer = torch.load(f"{folder}/trainer.pt", weights_only=True)
    assert trainer["optimizer"]["shards"] == 2 and "state" not in trainer["optimizer"]
    files = sorted(p.name for p in Path(folder).glob("optimizer-*"))
    assert files == ["optimizer-00001-of-00002.pt", "optimizer-00002-of-00002.pt"]
    counts = []
    for name in files:
        state = torch.load(f"{folder}/{name}", weights_only=True)["state"]
        counts.append(sum(m["exp_avg"].numel() for m in state.values()))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    total = sum(p.numel() for p in model.parameters())
    assert sum(counts) == total
    assert all(0.4 * total <= c <= 0.6 * total for c in counts), (counts, total)
    assert (Path(folder) / ".complete").exists() and (Path(folder) / ".rank-1").exists()


def test_optimizer_state_rekeys_both_ways():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    state = optimizer.state_dict()
    by_name = rekey_optimizer_state(state, names, by_name=True)
    assert by_name["param_groups"][0]["params"] == names
    assert set(by_name["state"]) == set(names)
    back = rekey_optimizer_state(by_name, names, by_name=False)
    assert back["param_groups"] == state["param_groups"]
    for i, moments in state["state"].items():
        for key, value in moments.items():
            assert torch.equal(back["state"][i][key], value)
    assert rekey_optimizer_state(by_name, names, by_name=True) == by_name  # already by name


def test_sharded_state_refuses_another_world_size(tmp_path):
    """A state sharded over 2 FSDP ranks is not resumed by 1 process: one line, which
    says what is accepted (the world size is checked before any file is read)."""
    from gagpo.learner.checkpoint import _read_shard
    from gagpo.schemas.errors import GagpoError

    with pytest.raises(GagpoError, match=r"sharded over 2 FSDP ranks.*runs 1 process") as err:
        _read_shard(tmp_path, 2, "learner/checkpoints/v4")
    assert "\n" not in str(err.value) and "parallel = fsdp on 2 processes" in str(err.value)


def test_parallel_config():
    assert LearnerConfig(store="s").parallel == "ddp"
    assert LearnerConfig(store="s", parallel="fsdp").parallel == "fsdp"
    with pytest.raises(ValidationError, match="fsdp does not support LoRA"):
        LearnerConfig(store="s", parallel="fsdp", lora={"enabled": True})
    with pytest.raises(ValidationError):
        LearnerConfig(store="s", parallel="zero3")


FSDP_BF16 = """
import os, torch, torch.distributed as dist
from gagpo.learner.dist import shard_model
from gagpo.learner.model import load_model
from tests.helpers.learner import tiny_model_dir
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
ids = torch.randint(3, 48, (2, 12), generator=torch.Generator().manual_seed(0))
plain = load_model(tiny_model_dir(), torch.device("cpu"))
ref = plain(input_ids=ids).logits.float().log_softmax(-1).mean()
sharded = load_model(tiny_model_dir(), torch.device("cpu"))
shard_model(sharded, "bf16")
out = sharded(input_ids=ids).logits
loss = out.float().log_softmax(-1).mean()
loss.backward()
params = list(sharded.parameters())
assert out.dtype == torch.bfloat16, out.dtype  # computed with bf16 parameters
assert all(p.dtype == torch.float32 for p in params)  # fp32 master weights
assert all(p.grad.dtype == torch.float32 for p in params if p.grad is not None)  # fp32 reduction
assert abs(float(loss) - float(ref)) < 0.02 * abs(float(ref)), (float(loss), float(ref))
dist.destroy_process_group()
print("ok")
"""


def test_fsdp_bf16_mixed_precision_keeps_fp32_master_weights():
    """`--parallel fsdp --precision bf16`: FSDP2's MixedPrecisionPolicy gathers bf16
    parameters for compute, keeps the sharded parameters and their gradients in fp32, and
    the loss stays close to fp32's (one gloo process; the CUDA run is in gpu_check.sh)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", FSDP_BF16],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**ENV, "PORT": str(port)},
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


SHARDED_PUBLICATION = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
from gagpo.learner.dist import barrier, init_dist, owned_weights, shard_model
from gagpo.learner.model import load_model
from gagpo.learner.publish import Publisher, Shards, VersionCopy, take_weights
from gagpo.storage.store import Store
torch.set_num_threads(1)
d = init_dist("cpu")
out, dtype = Path(sys.argv[1]), {"fp32": None, "bf16": torch.bfloat16}[sys.argv[2]]
base = Path(sys.argv[3])
model = load_model(base, torch.device("cpu"))
shard_model(model)
weights, owners = owned_weights(model, d, dtype)
(out / f"rank-{d.rank}.json").write_text(json.dumps(sorted(weights)))
publisher = Publisher(Store(str(out / "sharded")), model, base, keep=3)
publisher.publish(VersionCopy(1, 1, weights, {"version": 1}, dtype, Shards(d.rank, d.world, owners)))
publisher.wait()
barrier(d)
if d.main:  # the same weights, unsharded, as a single process publishes them
    whole, unsharded = Store(str(out / "whole")), load_model(base, torch.device("cpu"))
    single = Publisher(whole, unsharded, base, keep=3, asynchronous=False)
    single.write(VersionCopy(1, 1, take_weights(unsharded, dtype=dtype, copy=False), None, dtype))
dist.destroy_process_group()
"""


@pytest.mark.slow  # torchrun's start: 40-80 s each on the shared 2-core machine
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp_ranks_publish_their_own_shards_loadable_as_one_folder(tmp_path, dtype):
    """Under FSDP each of 2 gloo ranks writes the whole tensors it owns to its own file
    (model-0000r-of-00002.safetensors) and no rank gathers the model; rank 0 adds the
    index, config and tokenizer, then the marker and LATEST. The folder loads as it is
    in transformers and holds exactly the unsharded publication's tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    script = tmp_path / "publish.py"
    script.write_text(SHARDED_PUBLICATION)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", str(script), str(tmp_path), dtype, tiny_model_dir()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    sharded, whole = Store(str(tmp_path / "sharded")), Store(str(tmp_path / "whole"))
    assert sharded.policies.latest() == 1
    folder = tmp_path / "sharded" / "policy" / "v1"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = {r: load_file(folder / f"model-0000{r + 1}-of-00002.safetensors") for r in (0, 1)}
    mine = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        assert sorted(files[r]) == mine[r] and mine[r]  # a rank's file: its own tensors alone
        assert {
            n for n, f in index["weight_map"].items() if f.startswith(f"model-0000{r + 1}")
        } == set(mine[r])
    expected = load_file(tmp_path / "whole" / "policy" / "v1" / "model.safetensors")
    assert whole.policies.dir(1) and set(index["weight_map"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(files[0].get(name, files[1].get(name)), tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    plain = AutoModelForCausalLM.from_pretrained(
        tmp_path / "whole" / "policy" / "v1", local_files_only=True
    )
    assert type(loaded) is type(plain)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
