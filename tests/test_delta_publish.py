"""Delta publication (issue 40): a bf16 version stored as the zstd-compressed XOR of its
bits with the previous version's, a full version every K. Whatever chain a reader
replays (the previous version it holds, or the nearest full version and the deltas after
it), the folder it gets is the full bf16 version, bit for bit; pruning keeps the versions
a kept delta needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gagpo.learner import publish as P
from gagpo.learner.model import load_model
from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError
from gagpo.storage import delta as D
from gagpo.storage.folders import is_complete
from gagpo.storage.store import Store
from tests.helpers.learner import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY = 3  # v3, v6 full; v1 full too (the first a publisher writes); the rest deltas


def adam_like_step(model, seed: int, lr: float = 1e-4) -> None:
    """Move every weight by about `lr`, as an AdamW step does (|Δ| ≈ lr per weight)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(lr * torch.randn(p.shape, generator=gen).sign())


def bf16_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("*.safetensors"))}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Versions 1..7 of the tiny policy, each one AdamW-like step after the one before,
    published with deltas (K = EVERY) into one store and full into another; keep=2."""
    root = tmp_path_factory.mktemp("delta")
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    stores = {"delta": Store(str(root / "delta")), "full": Store(str(root / "full"))}
    publishers = {
        "delta": P.Publisher(
            stores["delta"], model, tiny_model_dir(), keep=2, asynchronous=False, delta_every=EVERY
        ),
        "full": P.Publisher(stores["full"], model, tiny_model_dir(), keep=100, asynchronous=False),
    }
    stored_after = {}
    for version in range(1, 8):
        adam_like_step(model, version)
        weights = P.take_weights(model, dtype=torch.bfloat16)
        for publisher in publishers.values():
            publisher.publish(P.VersionCopy(version, version, weights, None, torch.bfloat16))
            publisher.wait()
        stored_after[version] = stores["delta"].policies.stored()
    return stores, stored_after, root


def test_versions_are_full_every_k_and_deltas_between(published):
    stores, _, _ = published
    policies = stores["delta"].policies
    deltas = [v for v in policies.stored() if policies.is_delta(v)]
    full = [v for v in policies.stored() if not policies.is_delta(v)]
    assert deltas == [7] and full == [6]
    assert policies.base_of(7) == 6
    # a delta holds the XORed weights and no plain weights file
    names = {Path(p).name for p in stores["delta"].glob(policies.dir(7) + "/*")}
    assert "model.safetensors.xor.zst" in names and "model.safetensors" not in names


def test_pruning_keeps_the_chain_a_kept_delta_needs(published):
    _, stored_after, _ = published
    # keep=2: after v5 (a delta of v4, itself a delta of the full v3) v3 stays too
    assert stored_after[5] == [3, 4, 5]
    assert stored_after[6] == [3, 4, 5, 6]  # v5 is still among the newest two
    assert stored_after[7] == [6, 7]


@pytest.mark.parametrize("version", [6, 7])
def test_a_fetched_version_is_the_full_bf16_version_bit_for_bit(published, version, tmp_path):
    stores, _, _ = published
    fetched = stores["delta"].policies.fetch(version, str(tmp_path / "cache"))
    expected = bf16_files(Path(stores["full"].policies.dir(version)))
    assert bf16_files(Path(fetched)) == expected
    assert not (Path(fetched) / layout.DELTA).exists()


def test_each_reader_replays_the_shortest_chain(published, tmp_path, monkeypatch):
    """On a store with deltas v4, v5 after the full v3: a fresh reader fetches v3's folder
    and both deltas; a reader holding v4 downloads v5's delta alone."""
    _, _, root = published
    store = Store(str(root / "chain"))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    full = Store(str(root / "chain-full"))
    publisher = P.Publisher(
        store, model, tiny_model_dir(), keep=10, asynchronous=False, delta_every=EVERY
    )
    for version in range(3, 6):
        adam_like_step(model, 100 + version)
        weights = P.take_weights(model, dtype=torch.bfloat16)
        publisher.publish(P.VersionCopy(version, version, weights, None, torch.bfloat16))
        publisher.wait()
        P.write_weights(
            full,
            model,
            tiny_model_dir(),
            P.VersionCopy(version, version, weights, None, torch.bfloat16),
        )
    assert [store.policies.is_delta(v) for v in (3, 4, 5)] == [False, True, True]
    downloaded = []
    real = Store.download

    def recording(self, remote_dir, local_dir):
        downloaded.append(layout.parse_policy_dir(remote_dir))
        return real(self, remote_dir, local_dir)

    monkeypatch.setattr(Store, "download", recording)
    fresh = store.policies.fetch(5, str(tmp_path / "fresh"))
    assert sorted(downloaded) == [4, 5]  # v3 is a full local folder: read where it is
    assert bf16_files(Path(fresh)) == bf16_files(Path(full.policies.dir(5)))
    downloaded.clear()
    holder = tmp_path / "holder"
    store.policies.fetch(4, str(holder))
    downloaded.clear()
    store.policies.fetch(5, str(holder))
    assert downloaded == [5]


def test_a_delta_applied_to_the_wrong_base_is_refused(tmp_path):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=gen).to(torch.bfloat16)
    new = (base.float() + 1e-2 * torch.randn(4096, generator=gen)).to(torch.bfloat16)
    other = torch.randn(4096, generator=gen).to(torch.bfloat16)
    for name, tensor in {"base": base, "new": new, "other": other}.items():
        save_file({"w": tensor}, tmp_path / f"{name}.safetensors")
    record = D.encode_file(
        tmp_path / "new.safetensors", tmp_path / "base.safetensors", tmp_path / "d.zst"
    )
    D.apply_file(tmp_path / "d.zst", tmp_path / "base.safetensors", tmp_path / "out", record)
    assert (tmp_path / "out").read_bytes() == (tmp_path / "new.safetensors").read_bytes()
    with pytest.raises(GagpoError, match="CRC-32"):
        D.apply_file(tmp_path / "d.zst", tmp_path / "other.safetensors", tmp_path / "bad", record)


def test_odd_and_multi_chunk_files_round_trip(tmp_path, monkeypatch):
    """Chunks (made small here) and an odd tail: the byte split is undone exactly."""
    monkeypatch.setattr(D, "CHUNK", 1000)
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (4097,), generator=gen, dtype=torch.uint8).numpy().tobytes()
    flips = torch.randint(0, 256, (4097,), generator=gen, dtype=torch.uint8).numpy()
    flips[flips < 200] = 0
    new = bytes(a ^ b for a, b in zip(base, flips.tobytes(), strict=True))
    (tmp_path / "a").write_bytes(base)
    (tmp_path / "b").write_bytes(new)
    record = D.encode_file(tmp_path / "b", tmp_path / "a", tmp_path / "d")
    D.apply_file(tmp_path / "d", tmp_path / "a", tmp_path / "out", record)
    assert (tmp_path / "out").read_bytes() == new


def test_resume_reads_a_delta_version_whole(published, tmp_path):
    """--resume takes LATEST's weights through the registry's fetch: the full bf16 tensors."""
    from safetensors.torch import load_file

    from gagpo.learner.checkpoint import _published_weights

    stores, _, _ = published
    weights = _published_weights(stores["delta"], 7, str(tmp_path / "cache"))
    expected = load_file(str(Path(stores["full"].policies.dir(7)) / "model.safetensors"))
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], tensor)


def test_a_learner_publishes_deltas_and_resumes_from_one(store_dir):
    """`publish_delta_every`: the learner's versions after the first are deltas until the
    next multiple of K; --resume continues from a delta LATEST (its weights read whole) and
    its first version is full (it holds no previous one)."""
    from gagpo.learner.train import train
    from tests.helpers.learner import tiny_config, write_shards

    store = Store(str(store_dir))
    write_shards(store, 5, groups=2)
    store.policies.publish_base(str(tiny_model_dir()))
    cfg = dict(batch_groups=2, publish_delta_every=10, publish_dtype="bf16", keep_versions=2)
    assert train(tiny_config(store, updates=3, **cfg)).updates == 3
    policies = store.policies
    assert [policies.is_delta(v) for v in (1, 2, 3)] == [False, True, True]
    assert policies.stored() == [0, 1, 2, 3]  # keep=2, and v3's chain down to the full v1
    assert train(tiny_config(store, updates=5, resume=True, **cfg)).updates == 5
    assert [policies.is_delta(v) for v in (4, 5)] == [False, True]
    assert policies.latest() == 5 and policies.stored() == [0, 4, 5]


def test_closing_the_publisher_publishes_the_last_version_and_drops_the_held_base(
    tmp_path, monkeypatch
):
    """`Publisher.close`, the end of a learner's run (learner/train.py `Trainer.finish`):
    the version in flight is published first, then the full weights files held for the
    next delta (a whole copy of the model on the local disk) are removed at once, not
    whenever the publisher is collected; a later publication is refused."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    store = Store(str(tmp_path / "store"))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    publisher = P.Publisher(store, model, tiny_model_dir(), keep=5, delta_every=EVERY)
    weights = P.take_weights(model, dtype=torch.bfloat16)
    publisher.publish(P.VersionCopy(1, 1, weights, None, torch.bfloat16))
    (held,) = scratch.glob("gagpo-delta-*")
    publisher.close()
    assert store.policies.latest() == 1 and is_complete(store, store.policies.dir(1))
    assert not held.exists() and publisher.take_bytes() > 0
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(P.VersionCopy(2, 2, weights, None, torch.bfloat16))
    publisher.close()  # a second close: nothing left to do or raise
    assert store.policies.latest() == 1


def test_a_delta_version_on_an_object_store_is_fetched_whole(s3_endpoint, tmp_path):
    """On S3 every version is downloaded: a fresh reader gets v1 (full) and v2's delta, and
    applies it; the cache then holds both, whole, and no staging folder."""
    store = Store(f"s3://gagpo/{tmp_path.name}", skip_instance_cache=True)
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    publisher = P.Publisher(
        store, model, tiny_model_dir(), keep=5, asynchronous=False, delta_every=EVERY
    )
    expected = {}
    for version in (1, 2):
        adam_like_step(model, 200 + version)
        weights = P.take_weights(model, dtype=torch.bfloat16)
        publisher.publish(P.VersionCopy(version, version, weights, None, torch.bfloat16))
        publisher.wait()
        reference = tmp_path / f"full-v{version}"
        model.save_pretrained(reference, state_dict=weights)
        expected[version] = bf16_files(reference)
    assert store.policies.is_delta(2) and not store.policies.is_delta(1)
    cache = tmp_path / "cache"
    assert bf16_files(Path(store.policies.fetch(2, str(cache)))) == expected[2]
    assert bf16_files(Path(store.policies.fetch(1, str(cache)))) == expected[1]
    assert sorted(p.name for p in next(cache.iterdir()).iterdir()) == ["v1", "v2"]
