"""Publication: LATEST names only complete versions; the last K are kept; HF-loadable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gagpo.learner import publish as P
from gagpo.learner.model import add_lora, load_model
from gagpo.storage.folders import is_complete
from gagpo.storage.store import Store
from tests.helpers.learner import parameters, tiny_model_dir
from tests.helpers.publication import publish

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_model_dir(), torch.device("cpu"))


def test_published_version_loads_with_transformers(store_dir: Path, model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = Store(str(store_dir))
    folder = publish(store, model, tiny_model_dir(), 1, keep=3)
    assert store.policies.latest() == 1 and is_complete(store, folder)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, use_safetensors=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("w5") == 9
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_latest_moves_only_after_the_marker(store_dir: Path, model, monkeypatch):
    store = Store(str(store_dir))
    publish(store, model, tiny_model_dir(), 1, keep=3)

    def crash(phase):
        if phase == "publish":
            # Every file of v2 is in place, but not its marker: LATEST must still say 1.
            assert store.policies.latest() == 1
            raise RuntimeError("killed")

    monkeypatch.setattr(P, "fault_point", crash)
    with pytest.raises(RuntimeError):
        publish(store, model, tiny_model_dir(), 2, keep=3)
    assert store.policies.latest() == 1
    v2 = store.policies.dir(2)
    assert store.fs.exists(v2) and not is_complete(store, v2)
    monkeypatch.setattr(P, "fault_point", lambda phase: None)
    publish(store, model, tiny_model_dir(), 2, keep=3)  # the torn attempt is replaced
    assert store.policies.latest() == 2 and is_complete(store, store.policies.dir(2))


def test_only_the_last_k_versions_are_kept(store_dir: Path, model):
    store = Store(str(store_dir))
    for v in range(1, 6):
        publish(store, model, tiny_model_dir(), v, keep=2)
    assert store.policies.folders() == [4, 5] and store.policies.latest() == 5
    # An unmarked folder newer than LATEST may be a publication in flight: left alone.
    store.fs.makedirs(store.policies.dir(6))
    assert P.prune_versions(store, keep=1) == [4]
    assert store.policies.folders() == [5, 6]


def test_lora_publishes_merged_weights_or_an_adapter(store_dir: Path):
    from gagpo.learner.config import LoraSettings

    store = Store(str(store_dir))
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    add_lora(model, rank=2, alpha=4.0, targets=["q_proj", "v_proj"])
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    merged = parameters(publish(store, model, tiny_model_dir(), 1, keep=3))
    base = parameters(tiny_model_dir())
    assert set(merged) == set(base)
    assert not (
        merged["model.layers.0.self_attn.q_proj.weight"]
        == base["model.layers.0.self_attn.q_proj.weight"]
    ).all()
    assert (
        merged["model.layers.0.self_attn.k_proj.weight"]
        == base["model.layers.0.self_attn.k_proj.weight"]
    ).all()
    folder = Path(
        publish(
            store,
            model,
            tiny_model_dir(),
            2,
            keep=3,
            lora=LoraSettings(enabled=True, rank=2, alpha=4.0, publish="adapter"),
        )
    )
    assert (folder / "adapter_config.json").is_file()
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight" in parameters(folder)


def test_every_nth_version_is_kept_for_evaluation(store_dir: Path, model):
    store = Store(str(store_dir))
    for v in range(1, 8):
        publish(store, model, tiny_model_dir(), v, keep=2, keep_every=3)
    assert store.policies.folders() == [3, 6, 7]  # multiples of 3, and the newest 2
    assert P.prune_versions(store, keep=1) == [3, 6]  # without keep_every they go


def test_a_publisher_writes_in_a_thread_one_version_at_a_time(store_dir: Path, monkeypatch):
    """The copy handed over does not follow the model's next step; LATEST moves to a
    version only once its folder is complete; the next version waits for the one in
    flight; a failed write leaves LATEST where it was and is raised at the next wait."""
    import threading

    model = load_model(tiny_model_dir(), torch.device("cpu"))  # its own: changed below
    store = Store(str(store_dir))
    store.policies.set_latest(0)
    release = {1: threading.Event(), 2: threading.Event()}
    write = P.write_weights

    def held(store_, model_, base_dir, version, *args):
        release[version.version].wait(timeout=60)
        return write(store_, model_, base_dir, version, *args)

    monkeypatch.setattr(P, "write_weights", held)
    publisher = P.Publisher(store, model, tiny_model_dir(), keep=5)
    before = P.take_weights(model, dtype=torch.bfloat16)
    publisher.publish(P.VersionCopy(1, 1, before, {"version": 1}, torch.bfloat16))
    with torch.no_grad():  # the next update changes the weights in place meanwhile
        for p in model.parameters():
            p.add_(1.0)
    assert store.policies.latest() == 0 and not is_complete(store, store.policies.dir(1))
    second = P.VersionCopy(2, 2, P.take_weights(model), {"version": 2}, None)
    handed = threading.Thread(target=publisher.publish, args=(second,))
    handed.start()
    handed.join(timeout=0.5)
    assert handed.is_alive()  # at most one version in flight: v2 waits for v1
    assert not is_complete(store, store.policies.dir(2))
    release[1].set()
    handed.join(timeout=60)
    assert store.policies.latest() == 1
    published = load_file_tensors(store.policies.dir(1))
    for name, values in published.items():
        assert torch.equal(values, before[name]), name  # the copy, not the changed weights
    release[2].set()
    assert publisher.wait() > 0 and store.policies.latest() == 2  # v2's bytes
    assert publisher.take_bytes() > 0 and publisher.take_bytes() == 0

    def killed(phase: str) -> None:
        if phase == "publish":
            raise RuntimeError("killed mid-write")

    monkeypatch.setattr(P, "fault_point", killed)
    release[3] = threading.Event()
    release[3].set()
    publisher.publish(P.VersionCopy(3, 3, P.take_weights(model), {"version": 3}, None))
    with pytest.raises(RuntimeError, match="killed mid-write"):
        publisher.wait()
    assert store.policies.latest() == 2 and not is_complete(store, store.policies.dir(3))


def load_file_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")
