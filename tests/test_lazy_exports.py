"""The lazy exporter (schemas/lazy.py) and the packages that use it: a name's module is
imported on its first use, never at the package's import, and every package re-exports
through this one helper."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import types

import pytest

from gagpo.schemas.lazy import lazy_exports
from tests.helpers.tree import LAYERS, ROOT

PACKAGES = ["gagpo", "gagpo.envs", "gagpo.pipeline"]


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package `probe_pkg` whose names `answer` and `Thing` live in `probe_mod`, a module
    on the path that nothing has imported yet."""
    (tmp_path / "probe_mod.py").write_text("answer = 42\nclass Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "probe_mod", raising=False)
    package = types.ModuleType("probe_pkg")
    monkeypatch.setitem(sys.modules, "probe_pkg", package)
    names = {"answer": "probe_mod", "Thing": "probe_mod"}
    package.__all__, package.__getattr__, package.__dir__ = lazy_exports("probe_pkg", names)
    yield package
    sys.modules.pop("probe_mod", None)


def test_a_name_imports_its_module_on_first_use_and_stays(probe):
    assert probe.__all__ == ["Thing", "answer"]
    assert "probe_mod" not in sys.modules
    assert probe.answer == 42
    assert "probe_mod" in sys.modules
    assert vars(probe)["answer"] == 42  # kept: the next read is a plain attribute read
    assert probe.Thing is sys.modules["probe_mod"].Thing
    assert {"Thing", "answer"} <= set(dir(probe))


def test_an_unknown_name_is_an_attribute_error(probe):
    with pytest.raises(AttributeError, match="module 'probe_pkg' has no attribute 'missing'"):
        probe.missing  # noqa: B018
    assert not hasattr(probe, "also_missing")
    assert "probe_mod" not in sys.modules


def modules_after(code: str) -> set[str]:
    """The gagpo modules a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport sys, json\n"
        "print(json.dumps([m for m in sys.modules if m.startswith('gagpo')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_imports_none_of_its_names_modules(package):
    assert modules_after(f"import {package}") == {
        package,
        "gagpo",
        "gagpo.schemas",
        "gagpo.schemas.lazy",
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package):
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__) and module.__all__
    for name in module.__all__:
        getattr(module, name)  # an AttributeError here: a name mapped to the wrong module
        assert name in dir(module)


def test_the_readme_names_resolve():
    import gagpo

    assert callable(gagpo.open_store)
    assert issubclass(gagpo.GagpoError, Exception)
    assert gagpo.StoreReader.__module__ == "gagpo.inspection.library"


def test_no_other_module_writes_its_own_lazy_exporter():
    """A module-level `__getattr__` anywhere but schemas/lazy.py is a second copy of it."""
    own = []
    for folder in ["gagpo", *LAYERS]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "schemas" / "lazy.py":
                continue
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                    own.append(str(path.relative_to(ROOT)))
    assert own == []
