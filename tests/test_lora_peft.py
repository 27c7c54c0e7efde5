"""LoRA through peft: adapters the learner trains are standard PEFT folders.

A published adapter folder loads with transformers + peft as it is and gives the
learner's logits; merged publication gives them too; rank, alpha, dropout and target
modules reach the adapter config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gagpo.learner.cli import learner_command
from gagpo.learner.config import LearnerConfig, LoraSettings
from gagpo.learner.model import add_lora, load_model, lora_modules
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.learner import VOCAB, tiny_model_dir
from tests.helpers.publication import publish

pytestmark = pytest.mark.usefixtures("one_torch_thread")

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_model(seed: int = 0, dropout: float = 0.0):
    """The tiny model with adapters whose B is non-zero (as after some training)."""
    torch.manual_seed(seed)
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    add_lora(model, rank=4, alpha=8.0, targets=TARGETS, dropout=dropout)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def test_only_the_adapters_train_and_they_change_the_output():
    model = lora_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # 2 layers × 3 targets, one A and one B each
    assert len(trainable) == 2 * len(TARGETS) * 2 and len(lora_modules(model)) == 2 * len(TARGETS)
    base = load_model(tiny_model_dir(), torch.device("cpu")).eval()
    assert not torch.allclose(logits_of(model, IDS), logits_of(base, IDS))


def test_adapter_folder_loads_with_transformers_and_peft_and_gives_the_same_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = Store(str(tmp_path / "store"))
    model = lora_model()
    lora = LoraSettings(
        enabled=True, rank=4, alpha=8.0, dropout=0.05, target_modules=TARGETS, publish="adapter"
    )
    folder = Path(publish(store, model, tiny_model_dir(), 1, lora=lora))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["lora_dropout"] == 0.05 and sorted(config["target_modules"]) == sorted(TARGETS)
    assert not (folder / "config.json").exists()  # an adapter, not a model

    base = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(), local_files_only=True, use_safetensors=True, dtype=torch.float32
    )
    loaded = PeftModel.from_pretrained(base, folder).eval()
    torch.testing.assert_close(logits_of(loaded, IDS), logits_of(model, IDS), rtol=0, atol=1e-5)


def test_merged_publication_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    store = Store(str(tmp_path / "store"))
    model = lora_model(seed=3)
    folder = publish(store, model, tiny_model_dir(), 1)
    merged = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, use_safetensors=True, dtype=torch.float32
    ).eval()
    torch.testing.assert_close(logits_of(merged, IDS), logits_of(model, IDS), rtol=0, atol=1e-5)


def test_dropout_counts_as_dropout_and_no_match_is_one_line():
    from gagpo.learner.model import has_dropout

    assert has_dropout(lora_model(dropout=0.1)) and not has_dropout(lora_model())
    model = load_model(tiny_model_dir(), torch.device("cpu"))
    with pytest.raises(GagpoError, match="match no linear layer"):
        add_lora(model, rank=2, alpha=4.0, targets=["nope_proj"])


def test_lora_flags_reach_the_config(tmp_path, monkeypatch):
    seen = {}

    def fake_train(config, echo=None):
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr("gagpo.learner.train.train", fake_train)
    result = CliRunner().invoke(
        learner_command,
        [
            "--store",
            str(tmp_path),
            "--lora",
            "--lora-rank",
            "16",
            "--lora-alpha",
            "32",
            "--lora-dropout",
            "0.1",
            "--lora-target-modules",
            "q_proj, v_proj",
            "--precision",
            "bf16",
        ],
    )
    assert result.exit_code == 0, result.output
    cfg: LearnerConfig = seen["config"]
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.lora.alpha == 32.0
    assert cfg.lora.dropout == 0.1 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.precision == "bf16"
    bad = CliRunner().invoke(learner_command, ["--store", str(tmp_path), "--lora-dropout", "1.5"])
    assert isinstance(bad.exception, GagpoError) and "lora.dropout" in str(bad.exception)


def test_actors_on_transformers_serve_an_adapter_version_as_the_learner_has_it(tmp_path):
    """The actor side: a published adapter version, merged into the base by
    `load_version`, samples from the learner's policy (same logits)."""
    from gagpo.actors.policies.presets import load_policy, load_version, tiny_dir

    store = Store(str(tmp_path / "store"))
    torch.manual_seed(0)
    model = load_model(tiny_dir(), torch.device("cpu"))
    add_lora(model, rank=2, alpha=4.0, targets=["q_proj", "v_proj"])
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    lora = LoraSettings(
        enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"], publish="adapter"
    )
    folder = Path(publish(store, model.eval(), tiny_dir(), 1, lora=lora))
    policy = load_policy("tiny", backend="transformers", device="cpu")
    policy = load_version(policy, folder, 1, device="cpu")
    assert policy.version == 1 and policy.model_dir == folder
    ids = torch.tensor([policy.encode_chat([{"role": "user", "content": "look"}])])
    torch.testing.assert_close(
        logits_of(policy.model, ids), logits_of(model, ids), rtol=0, atol=1e-5
    )
    assert len(policy.generate([ids[0].tolist()] * 2, seed=0)) == 2
