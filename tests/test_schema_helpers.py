"""The small helpers every layer shares, defined once in schemas/: atomic local writes,
`module:function` loading, seed derivation, what a `--policy` value names (staleness:
tests/test_staleness.py)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.loader import load_object
from gagpo.schemas.policy import PolicySpec
from gagpo.schemas.seeds import derive_seed
from gagpo.storage.files import atomic_write, build_once


def test_atomic_write_replaces_whole_or_leaves_the_old_file(tmp_path: Path):
    path = tmp_path / "sub" / "out.txt"
    atomic_write(path, lambda temp: temp.write_text("one"))
    assert path.read_text() == "one"

    def fail(temp: Path) -> None:
        temp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "one" and [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_build_once_builds_a_folder_once(tmp_path: Path):
    calls = []
    for _ in range(2):
        build_once(tmp_path / "f", lambda temp: calls.append((temp / "x").write_text("x")))
    assert len(calls) == 1 and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_load_object_errors_are_one_line(tmp_path: Path, monkeypatch):
    (tmp_path / "helpers_mod.py").write_text("value = 3\ndef f(x):\n    return x\n")
    (tmp_path / "helpers_bad.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_object("helpers_mod:f", "fn")(2) == 2
    cases = {
        "helpers_mod": "fn is not module:function",
        "helpers_mod:g": "fn cannot be loaded: cannot load 'g' from module 'helpers_mod'",
        "no_such_module_x:f": "fn cannot be loaded: .*ModuleNotFoundError",
        "helpers_bad:f": r"fn: module 'helpers_bad' fails to import \(SyntaxError",
        "helpers_mod:value": r"fn is not callable \(int\)",
    }
    for spec, message in cases.items():
        with pytest.raises(GagpoError, match=message) as err:
            load_object(spec, "fn")
        assert "\n" not in str(err.value)
    for name in ("helpers_mod", "helpers_bad"):
        sys.modules.pop(name, None)


def test_derive_seed_is_a_digest_of_the_parts():
    digest = hashlib.blake2b(b"7:run:3", digest_size=4).digest()
    assert derive_seed(7, "run", 3, bits=32) == int.from_bytes(digest, "little")
    assert derive_seed(7, "run", 3) == derive_seed(7, "run", 3, bits=32) & 0x7FFF_FFFF
    assert derive_seed(1, 2) != derive_seed(2, 1) and 0 <= derive_seed(1, bits=63) < 1 << 63


def test_policy_spec_tells_presets_hub_ids_and_folders_apart(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tiny").mkdir()  # a preset's name names the preset, whatever folder is here
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local folder is no hub id
    assert PolicySpec.parse("tiny") == PolicySpec("preset", "tiny")
    assert PolicySpec.parse("smollm2-135m") == PolicySpec("preset", "smollm2-135m")
    assert PolicySpec.parse("acme/agent") == PolicySpec("hub", "acme/agent")
    assert PolicySpec.parse("acme/agent@v1") == PolicySpec("hub", "acme/agent@v1")
    assert PolicySpec.parse("org/name") == PolicySpec("folder", "org/name")
    assert PolicySpec.parse("./org/name") == PolicySpec("folder", "org/name")
    assert PolicySpec.parse("~/org") == PolicySpec("folder", f"{tmp_path}/org")
    assert PolicySpec.parse(tmp_path / "tiny") == PolicySpec("folder", f"{tmp_path}/tiny")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("nosuchpolicy", "name"),
        ("", "name"),
        ("notes.txt", "name"),  # a file, not a folder
        ("/no/such/model", "path"),
        ("./absent", "path"),
        ("~/absent", "path"),
        ("a/b/c", "path"),  # two slashes: no hub id
        ("org/ name", "path"),  # a space around a part: no hub id
        ("dir/notes.txt", "path"),  # a file, not a folder
    ],
)
def test_policy_spec_rejects_what_names_no_policy(tmp_path: Path, monkeypatch, text, kind):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(GagpoError) as err:
        PolicySpec.parse(text)
    assert (
        str(err.value)
        == {
            "name": f"policy {text!r} is neither a preset nor a folder; accepted: tiny, "
            "smollm2-135m, a Hugging Face model folder, or a hub id (org/name)",
            "path": f"model path '{text}' does not exist; accepted: tiny, smollm2-135m, a folder "
            "holding a Hugging Face model, or a hub id (org/name) in the local cache",
        }[kind]
    )
