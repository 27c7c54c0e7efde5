"""The small helpers every layer shares, defined once in schemas/: atomic local writes,
`module:function` loading, seed derivation (staleness: tests/test_staleness.py)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.schemas.files import atomic_write, build_once
from gagpo.schemas.loader import load_object
from gagpo.schemas.seeds import derive_seed


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
