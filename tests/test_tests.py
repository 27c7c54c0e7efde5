"""The tests' own layering: what several test modules share lives in tests/helpers/ or is a
fixture of tests/conftest.py; a test module never imports from another test module (pytest
would then collect, and run, the imported module's fixtures and tests twice over)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_test_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a `tests.test_*` module in `path`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # relative imports are read as from the tests package (`from .test_x import y`)
            package = "tests" if node.level else ""
            module = ".".join(p for p in (package, node.module or "") if p)
            if module.startswith("tests.test_"):
                names = [module]
            else:  # `from tests import test_x`
                names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("tests.test_")]
    return found


def test_no_test_module_imports_another():
    sources = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    bad = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in sorted(sources)
        for line, module in imported_test_modules(path)
    ]
    assert not bad, "move what is shared to tests/helpers/ or tests/conftest.py:\n" + "\n".join(bad)


def test_the_check_sees_every_form_of_import(tmp_path: Path):
    module = tmp_path / "test_x.py"
    module.write_text(
        "import tests.test_a\n"
        "from tests.test_b import helper\n"
        "from tests import test_c\n"
        "from .test_d import helper\n"
        "def f():\n    from tests.test_e import helper\n"
        "from tests.helpers.learner import ROOT\n"
    )
    assert [m for _, m in imported_test_modules(module)] == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.test_d",
        "tests.test_e",
    ]
