"""The front door: the design card's layout, the gagpo namespace, extras and --version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from gagpo.storage.store import Store
from tests.helpers.steps import make_steps
from tests.helpers.tree import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_ships():
    """Each folder of Python modules under a layer is a package listed in pyproject.toml
    (one left out would be missing from the wheel), and each listed package exists."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed, found, loose = set(setuptools["packages"]), set(), []
    for package, folder in setuptools["package-dir"].items():
        for module in (ROOT / folder).rglob("*.py"):
            parts = module.parent.relative_to(ROOT / folder).parts
            if (module.parent / "__init__.py").is_file():
                found.add(".".join([package, *parts]))
            else:
                loose.append(str(module.relative_to(ROOT)))
    assert loose == [] and found == listed
    # The layers, and gagpo/ itself: the one module at the top (`gagpo.open_store`).
    assert set(setuptools["package-dir"]) == {"gagpo"} | {f"gagpo.{layer}" for layer in LAYERS}


def test_no_generic_top_level_package_is_importable_outside_the_checkout(tmp_path: Path):
    code = (
        "import importlib.util as u, json; "
        f"print(json.dumps({{m: u.find_spec(m) is not None for m in {LAYERS!r}}})); "
        "import gagpo.pipeline.advantages, gagpo.storage.store, gagpo.workflows.cli"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert '"schemas": false' in out.stdout and '"pipeline": false' in out.stdout, out.stdout


def test_the_docs_name_every_extra_and_what_all_leaves_out():
    extras = PYPROJECT["project"]["optional-dependencies"]
    (inside,) = re.findall(r"gagpo\[([^\]]+)\]", " ".join(extras["all"]))
    inside = set(inside.split(","))
    left_out = set(extras) - inside - {"all", "dev"}
    assert inside and left_out  # vllm and the trackers at least
    readme = (ROOT / "README.md").read_text()
    row = next(
        line for line in readme.splitlines() if line.startswith("| `pip install 'gagpo[all]'")
    )
    included, _, excluded = row.split("|")[2].partition("not")
    words = lambda text: set(re.findall(r"[a-z][a-z0-9-]*[a-z0-9]", text))  # noqa: E731
    assert inside <= words(included) and not inside & words(excluded)
    assert left_out <= words(excluded)
    design = (ROOT / "docs" / "design.md").read_text()
    paragraph = design[design.index("**Extras.**") :].split("\n\n")[0]
    assert {name for name in extras if f"`{name}`" not in paragraph} == set()


def test_relative_links_in_the_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            local = "://" not in target and not target.startswith("mailto:")
            if local and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_version_is_the_package_version():
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", "gagpo.workflows.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert out.stdout.strip() == f"gagpo {version('gagpo')}"


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    import importlib.util

    from gagpo.schemas import extras

    real = importlib.util.find_spec
    monkeypatch.setattr(
        extras.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(extras.MissingExtra, match=r"needs the 'report' extra \(matplotlib"):
        extras.require("report", "gagpo report")


@pytest.mark.slow
def test_core_install_inspects_a_store_without_torch(tmp_path: Path):
    """`pip install .` (no extras) into a fresh venv: advantages and SQL work, torch absent."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        env=pip_env,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert (site / "gagpo" / "pipeline" / "advantages.py").is_file()
    assert not any((site / name).exists() for name in LAYERS)
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.stdout.strip() == "None", "the core extra must not pull torch"

    store = Store(str(tmp_path / "store"))
    steps = make_steps(groups=2, group_size=3)
    store.write_shard(steps, group_size=3)
    bin_dir = env_dir / "bin"
    run = {"capture_output": True, "text": True, "timeout": 300, "cwd": tmp_path}
    adv = subprocess.run(
        [str(bin_dir / "gagpo"), "advantages", "--store", store.url, "--estimator", "gagpo"], **run
    )
    assert adv.returncode == 0, adv.stderr
    sql = subprocess.run(
        [
            str(bin_dir / "gagpo"),
            "sql",
            "--store",
            store.url,
            "select count(*) as n from advantages where estimator like 'gagpo%'",
        ],
        **run,
    )
    assert sql.returncode == 0, sql.stderr
    assert str(steps.num_rows) in sql.stdout.split(), sql.stdout
    learner = subprocess.run(
        [str(bin_dir / "gagpo"), "learner", "--store", store.url, "--policy", "tiny"], **run
    )
    assert learner.returncode == 2
    assert "pip install 'gagpo[learner]'" in learner.stderr
    assert "Traceback" not in learner.stderr
