"""Issue 40: what the learner writes after each update, and what it costs.

Publication in the dtype actors serve (bf16 when training bf16), the commit's costs in
the metrics (publish_s, state_s, bytes_written), the training state every `state_every`
updates written by a thread (whole or not at all), and --resume between two states:
LATEST's weights, the newest complete state's optimiser, the scheduler at LATEST's step
(docs/design.md, "One lineage")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from gagpo.inspection import sql
from gagpo.learner import publish as P
from gagpo.learner.checkpoint import start
from gagpo.learner.feed import Ledger
from gagpo.learner.lease import release_lease
from gagpo.learner.metrics import read_metrics
from gagpo.learner.model import load_model
from gagpo.learner.state import (
    StateWriter,
    checkpoint_dir,
    newest_state,
    snapshot_state,
    state_versions,
)
from gagpo.learner.train import lr_factor, make_optimizer, train
from gagpo.schemas.layout import COMPLETE, LINEAGE, STATE_TRAINER
from gagpo.storage.folders import is_complete
from gagpo.storage.store import Store
from tests.helpers.learner import parameters, tiny_config, tiny_model_dir, write_shards
from tests.helpers.publication import publish

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dtypes(folder: str) -> set[torch.dtype]:
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)


def _folder_bytes(store: Store, folder: str) -> int:
    """Bytes of a folder's files, its `.complete` marker aside (the commit, not the data)."""
    sizes = store.fs.find(folder, detail=True)
    return sum(info["size"] for path, info in sizes.items() if not path.endswith(COMPLETE))


def test_bf16_training_publishes_bf16_and_resumes(tmp_path):
    """--precision bf16 publishes bf16 weights (config.json says so), half of fp32's bytes;
    the learner resumes from them; fp32 training still publishes fp32."""
    store = Store(str(tmp_path / "bf16"))
    write_shards(store, 3)
    train(tiny_config(store, precision="bf16", keep_versions=10))
    folder = store.policies.dir(2)
    assert _dtypes(folder) == {torch.bfloat16}
    assert json.loads(Path(folder, "config.json").read_text())["dtype"] == "bfloat16"
    assert train(tiny_config(store, precision="bf16", updates=3, resume=True)).updates == 3
    assert _dtypes(store.policies.dir(3)) == {torch.bfloat16}

    fp32 = Store(str(tmp_path / "fp32"))
    write_shards(fp32, 2)
    train(tiny_config(fp32, keep_versions=10))
    assert _dtypes(fp32.policies.dir(2)) == {torch.float32}
    weights = {p: _folder_bytes(s, s.policies.dir(2)) for p, s in (("bf16", store), ("fp32", fp32))}
    assert weights["bf16"] < 0.7 * weights["fp32"]  # the tokenizer files are the same


def test_bf16_publication_is_the_rounded_master_weights(store_dir: Path):
    """Every tensor is the fp32 master rounded to bf16; the tied head is written once."""
    store = Store(str(store_dir))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    folder = publish(store, model, tiny_model_dir(), 1, dtype=torch.bfloat16)
    published = load_file(f"{folder}/model.safetensors")
    master = model.state_dict()
    assert "lm_head.weight" not in published  # tied to the embeddings, as in fp32
    for name, values in published.items():
        assert values.dtype == torch.bfloat16
        assert torch.equal(values, master[name].to(torch.bfloat16)), name


def test_commit_costs_in_metrics_console_and_sql(tmp_path):
    """publish_s, state_s and bytes_written per update: in learner/metrics/, the console
    line and `gagpo sql`; the bytes add up to the files of every version and state."""
    store = Store(str(tmp_path / "store"))
    write_shards(store, 5)
    lines: list[str] = []
    options = dict(updates=5, state_every=2, state_async=False, keep_versions=10)
    train(tiny_config(store, keep_checkpoints=10, **options), echo=lines.append)
    assert state_versions(store) == [2, 4, 5]  # every 2 updates, and the run's last
    metrics = read_metrics(store)
    assert (metrics["publish_s"] > 0).all() and (metrics["state_s"] >= 0).all()
    written = sum(_folder_bytes(store, store.policies.dir(v)) for v in range(1, 6))
    written += sum(_folder_bytes(store, checkpoint_dir(store, v)) for v in (2, 4, 5))
    assert metrics["bytes_written"].sum() == written
    assert all("publish " in line and " MiB" in line for line in lines if "→ v" in line)
    connection = sql.open_store_db(store)
    got = sql.run_query(
        connection, 'SELECT "update", publish_s, state_s, bytes_written FROM learner_metrics'
    ).to_pylist()
    connection.close()
    expected = metrics.select("update", "publish_s", "state_s", "bytes_written").to_dicts()
    assert sorted(got, key=lambda r: r["update"]) == expected


def test_resume_between_states_takes_latest_weights_and_the_newest_moments(tmp_path):
    """States at v2 and v4, v5's write killed (no marker): --resume restores v5's own
    weights, v4's AdamW moments and step count, the learning rate of v5's step (2
    optimiser steps per update, a linear schedule), and the ledger of 5 updates."""
    store = Store(str(tmp_path / "store"))
    write_shards(store, 5)
    cfg = tiny_config(
        store,
        updates=5,
        state_every=2,
        mini_batches=2,
        lr_schedule="linear",
        keep_versions=10,
        keep_checkpoints=10,
    )
    train(cfg)
    store.fs.rm(f"{checkpoint_dir(store, 5)}/{COMPLETE}")  # the state of v5: a killed write
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    optimizer, scheduler = make_optimizer(model, cfg)
    lines: list[str] = []
    head, ledger = start(
        store,
        resume=True,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        steps_per_update=2,
        say=lines.append,
    )
    release_lease(store)
    v5 = json.loads(store.fs.cat_file(f"{store.policies.dir(5)}/{LINEAGE}"))
    assert (head.update, head.version, head.id) == (5, 5, v5["id"])
    assert lines == [
        "--resume: v5's weights with the optimiser moments of v4, the newest complete state "
        "(1 update(s) older; docs/design.md, 'One lineage')"
    ]
    assert state_versions(store) == [2, 4]  # the torn folder is gone
    published = parameters(store.policies.dir(5))
    for name, tensor in model.state_dict().items():
        if name in published:
            np.testing.assert_array_equal(tensor.numpy(), published[name], err_msg=name)
    saved = torch.load(f"{checkpoint_dir(store, 4)}/{STATE_TRAINER}", weights_only=True)
    restored = optimizer.state_dict()["state"]
    assert restored.keys() == saved["optimizer"]["state"].keys()
    for i, moments in saved["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(restored[i][key], value), (i, key)
    assert int(restored[0]["step"]) == 8  # v4's: 4 updates of 2 steps
    expected_lr = cfg.lr * lr_factor(10, cfg.updates * cfg.mini_batches, cfg)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr, rel=1e-12)
    assert scheduler.last_epoch == 10
    assert len(ledger.rows) == 10 and len(Ledger.load(store).rows) == 10


def test_a_state_is_a_copy_written_whole_or_not_at_all(store_dir: Path, monkeypatch):
    """The copy handed to the writer thread does not follow the optimiser's next step; a
    write that fails before its marker leaves the previous state in force and is raised
    on the learner's thread at the next wait."""
    store = Store(str(store_dir))
    store.policies.set_latest(2)
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def step() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()

    step()
    taken = {i: s["exp_avg"].clone() for i, s in optimizer.state_dict()["state"].items()}
    args = (model, optimizer, scheduler, Ledger())
    snapshot = snapshot_state(store, 1, {"version": 1}, *args, copy_tensors=True)
    step()  # the next update runs while the state is written
    writer = StateWriter(store, keep=5, asynchronous=True)
    writer.save(snapshot)
    writer.wait()
    saved = torch.load(f"{checkpoint_dir(store, 1)}/{STATE_TRAINER}", weights_only=True)
    for i, exp_avg in taken.items():
        assert torch.equal(saved["optimizer"]["state"][i]["exp_avg"], exp_avg)
    assert writer.take_bytes() == _folder_bytes(store, checkpoint_dir(store, 1))

    def killed(phase: str) -> None:
        if phase == "checkpoint":
            raise RuntimeError("killed mid-write")

    monkeypatch.setattr(P, "fault_point", killed)
    writer.save(snapshot_state(store, 2, {"version": 2}, *args, copy_tensors=True))
    with pytest.raises(RuntimeError, match="killed mid-write"):
        writer.wait()
    assert store.fs.exists(checkpoint_dir(store, 2))  # its files, but no marker
    assert newest_state(store, 2) == 1


def test_versions_are_written_by_a_thread_and_latest_names_only_complete_ones(
    tmp_path, monkeypatch
):
    """With publish_async (the default) every version but the run's last is written by
    the publishing thread while the next update runs; LATEST, polled throughout, only
    ever names a complete folder, and never moves back."""
    import threading
    import time

    store = Store(str(tmp_path / "store"))
    write_shards(store, 5)
    writers: dict[int, str] = {}
    write = P.write_weights

    def slow(store_, model, base_dir, version, *args):
        writers[version.version] = threading.current_thread().name
        time.sleep(0.3)  # longer than a tiny update: the next one runs meanwhile
        return write(store_, model, base_dir, version, *args)

    monkeypatch.setattr(P, "write_weights", slow)
    seen: list[tuple[int, bool]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            latest = store.policies.latest()
            if latest:
                seen.append((latest, is_complete(store, store.policies.dir(latest))))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        train(tiny_config(store, updates=5, keep_versions=10))
    finally:
        done.set()
        watcher.join()
    assert writers == {v: f"gagpo-publish-v{v}" for v in range(1, 5)} | {5: "MainThread"}
    assert seen and all(complete for _, complete in seen)
    order = [v for i, (v, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != v]
    assert order == sorted(order) and order[-1] == 5
    assert read_metrics(store)["update"].to_list() == [1, 2, 3, 4, 5]
