"""A Hugging Face hub id as --policy: found in the local cache (never downloaded), or one
line saying it is not there and how to fetch it."""

from __future__ import annotations

import shutil

import pytest

from gagpo.actors.policies.presets import resolve_model
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.policy import is_hub_id
from tests.helpers.learner import tiny_model_dir


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_hub_ids_are_told_from_paths(tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name@v1")
    assert not is_hub_id("./org/name") and not is_hub_id("/abs/path") and not is_hub_id("tiny")
    assert not is_hub_id(str(tmp_path / "a" / "b"))


def test_a_cached_hub_model_resolves_to_its_snapshot(hub_cache):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--acme--tiny-agent"
    shutil.copytree(tiny_model_dir(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_model("acme/tiny-agent") == repo / "snapshots" / commit


def test_a_hub_model_not_in_the_cache_is_one_line(hub_cache):
    with pytest.raises(GagpoError) as error:
        resolve_model("acme/absent-model")
    message = str(error.value)
    assert "'acme/absent-model' is not in the local Hugging Face cache" in message
    assert "hf download acme/absent-model" in message and "\n" not in message
