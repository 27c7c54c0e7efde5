"""schemas/layout.py is the one owner of the store's layout (issue 31).

1. No module of the package builds a store path from a folder or file name of its own
   (benchmarks/ are left out: they read stores from outside, as any tool, and some run
   against older checkouts that have no schemas/layout.py). Read with `ast`, a *path join* is
   - a call `X.path(...)` (Store.path), `posixpath.join`, `os.path.join`, `Path(...)`,
     `PurePosixPath(...)` or `X.joinpath(...)`: its parts are the arguments, its base the
     receiver of `.path` or else the first argument;
   - a chain of `/` (pathlib) or of `+` with a string starting with "/": its parts are the
     operands, its base the leftmost one;
   - an f-string where a formatted value is followed by "/" (`f"{store.url}/learner/…"`):
     its base is that value, its parts what follows, the text split at "/".
   A join is *from a store* when its base names a store: an identifier holding "store",
   "root" or "url", or a `.path(...)` call. It breaks the rule when
   a. a part is a string literal equal to a name of `layout.NAMES`, in a join from a store
      (`store.path("learner", "ledger.parquet")`, `Path(store_root) / "report"`);
   b. a part is a string literal equal to a *file* name of the layout (`ledger.parquet`,
      `LATEST`, `.complete`, …: names no other path has), in any join;
   c. a part is a layout constant (`LEARNER`, `layout.LEDGER`, `C.LEARNER_METRICS_DIR`, …)
      in a join from a store: `store.path(LEARNER, LEDGER)` copies layout's function;
   d. a module-level constant named as a path (…_DIR, …_FILE, …_NAME, …) is assigned a
      layout name (`LEASE_DIR = "lease"`): a second owner of that name.
   Docstrings are not joins; messages that name a path are, and call layout too.
2. docs/store.md's layout block is `layout.listing()`, and the README, docs/design.md and
   storage/store.py point to it instead of listing the layout themselves.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gagpo.schemas import layout
from tests.helpers.tree import LAYERS

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = LAYERS
OWNER = Path("schemas/layout.py")
FILE_NAMES = {n for n in layout.NAMES if "." in n or n.isupper()}
CONSTANTS = {k for k, v in vars(layout).items() if k.isupper() and v in layout.NAMES} | {
    "LEARNER_METRICS_DIR",  # schemas/columns.py's aliases
    "LEARNER_HISTOGRAMS",
}
STOREISH = re.compile(r"store|root|url", re.IGNORECASE)


def _identifiers(node: ast.AST) -> list[str]:
    return [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Name | ast.Attribute)
    ]


def _from_store(base: ast.AST | None) -> bool:
    if base is None:
        return False
    calls_path = any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "path"
        for n in ast.walk(base)
    )
    return calls_path or any(STOREISH.search(name) for name in _identifiers(base))


def _literal_parts(node: ast.AST) -> list[str]:
    """The names a part spells: a string split at '/', or an f-string's text split at '/'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("/")
    if isinstance(node, ast.JoinedStr):
        return [p for v in node.values if isinstance(v, ast.Constant) for p in v.value.split("/")]
    return []


def _constant_parts(node: ast.AST) -> list[str]:
    nodes = [node]
    if isinstance(node, ast.JoinedStr):
        nodes = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
    return [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in nodes
        if isinstance(n, ast.Name | ast.Attribute)
    ]


def _operands(node: ast.BinOp, op: type) -> list[ast.AST]:
    if isinstance(node.left, ast.BinOp) and isinstance(node.left.op, op):
        return [*_operands(node.left, op), node.right]
    return [node.left, node.right]


def _joins(tree: ast.AST):
    """(node, base, parts) of every path join in `tree` (see the module docstring)."""
    inner = {
        id(n.left)
        for n in ast.walk(tree)  # a / b / c: one join, not two
        if isinstance(n, ast.BinOp)
        and isinstance(n.left, ast.BinOp)
        and type(n.op) is type(n.left.op)
    }
    for node in ast.walk(tree):
        if id(node) in inner:
            continue
        if isinstance(node, ast.Call):
            func, name = node.func, getattr(node.func, "attr", getattr(node.func, "id", ""))
            if isinstance(func, ast.Attribute) and name == "path":
                yield node, func.value, list(node.args)
            elif name in ("join", "joinpath", "Path", "PurePosixPath") and node.args:
                if name == "join" and not any(
                    i in ("posixpath", "path") for i in _identifiers(func)
                ):
                    continue  # str.join and friends
                yield node, node.args[0], list(node.args)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div | ast.Add):
            parent_op = type(node.op)
            operands = _operands(node, parent_op)
            if isinstance(node.op, ast.Add) and not any(
                _literal_parts(o)[:1] == [""] and len(_literal_parts(o)) > 1 for o in operands[1:]
            ):
                continue  # a sum, or strings glued without a "/"
            yield node, operands[0], operands
        elif isinstance(node, ast.JoinedStr):
            values = node.values
            for i, value in enumerate(values[:-1]):
                after = values[i + 1]
                if (
                    isinstance(value, ast.FormattedValue)
                    and isinstance(after, ast.Constant)
                    and after.value.startswith("/")
                ):
                    yield node, value.value, [ast.JoinedStr(values[i + 1 :])]
                    break


def violations(path: Path) -> list[tuple[str, int, str, str]]:
    """(module, line, rule, source) of every way `path` breaks the rule."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    module = path.relative_to(ROOT).as_posix()
    found = []
    for node, base, parts in _joins(tree):
        from_store = _from_store(base)
        for part in parts:
            names = set(_literal_parts(part))
            rule = (
                "a"
                if from_store and names & layout.NAMES
                else "b"
                if names & FILE_NAMES
                else "c"
                if from_store and set(_constant_parts(part)) & CONSTANTS
                else ""
            )
            if rule:
                segment = ast.get_source_segment(source, node).splitlines()[0]
                found.append((module, node.lineno, rule, segment))
                break
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and node.value.value in layout.NAMES
            and _names_a_path(node)
        ):
            found.append((module, node.lineno, "d", ast.get_source_segment(source, node)))
    return found


PATHISH = re.compile(r"(DIR|FILE|FOLDER|PATH|NAME|ROOT|PREFIX|SUFFIX)S?$")


def _names_a_path(node: ast.Assign) -> bool:
    """A constant named as a folder or file (LEASE_DIR, LEDGER_FILE): "policy" as the
    endpoint's model name (DEFAULT_MODEL) is no store path."""
    return any(isinstance(t, ast.Name) and PATHISH.search(t.id) for t in node.targets)


def _modules() -> list[Path]:
    return sorted(
        p
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if p.relative_to(ROOT) != OWNER
    )


def test_no_module_but_layout_names_store_paths():
    found = [v for p in _modules() for v in violations(p)]
    assert not found, "store paths built outside schemas/layout.py:\n" + "\n".join(
        f"  {m}:{line} (rule {rule}) {src}" for m, line, rule, src in found
    )


def test_the_check_catches_what_it_is_for(tmp_path):
    """Each rule on a module that breaks it, and the forms that are not store paths."""
    bad = {
        'store.path("learner", "ledger.parquet")': "a",
        'posixpath.join(store.root, "policy", "LATEST")': "a",
        'Path(store_root) / "learner" / "tensorboard"': "a",
        'f"{store.url}/learner/histograms.zarr"': "a",
        'store.url.rstrip("/") + "/eval/heldout.parquet"': "a",
        'os.path.join(folder, "lineage.json")': "b",
        'folder / ".complete"': "b",
        "store.path(LEARNER, LEDGER)": "c",
        "posixpath.join(store.root, layout.POLICY)": "c",
        'store.url + f"/{LEARNER}/{C.LEARNER_HISTOGRAMS}"': "c",
    }
    fine = [
        "layout.ledger(store.root)",
        'os.path.join(tempfile.gettempdir(), "ray")',  # not a store: a folder of its own
        'f"store {url!r} holds no {SHARDS}/ or {POLICY}/"',  # a message
        '"/".join(["learner", "metrics"])',
        "folder / STATE_TRAINER",  # a local folder of layout's file names
    ]
    module = ROOT / "tests" / "_layout_probe.py"
    try:
        for expression, rule in bad.items():
            module.write_text(f"x = {expression}\n")
            assert [v[2] for v in violations(module)] == [rule], expression
        for expression in fine:
            module.write_text(f"x = {expression}\n")
            assert violations(module) == [], expression
        module.write_text('LEASE_DIR = "lease"\n')
        assert [v[2] for v in violations(module)] == ["d"]
        module.write_text('DEFAULT_MODEL = "policy"\n')  # a model's name, not a folder
        assert violations(module) == []
    finally:
        module.unlink(missing_ok=True)


# --- 2. one listing, in docs/store.md ------------------------------------------------------
def _layout_block(text: str) -> str:
    section = text.split("\n## Layout\n", 1)[1]
    return re.search(r"```\n(.*?)\n```", section, flags=re.S).group(1)


def test_docs_store_md_lists_the_layout_of_layout_py():
    block = _layout_block((ROOT / "docs" / "store.md").read_text(encoding="utf-8"))
    assert block == layout.listing(), (
        "docs/store.md's layout block is not layout.listing(); paste this:\n" + layout.listing()
    )
    listed = {p for p, _ in layout.LAYOUT}
    for top in (
        "shards",
        "archive",
        "advantages",
        "policy",
        "learner",
        "eval",
        "ray",
        "report",
        "quarantine",
    ):
        assert any(p.startswith(f"STORE/{top}/") for p in listed), top


def test_other_listings_point_to_docs_store_md():
    """The README and design.md name the top folders and point to the full listing;
    store.py's docstring points to it. None writes the layout out a second time."""
    tops = {p.split("/")[1] for p, _ in layout.LAYOUT}
    for name in ("README.md", "docs/design.md", "storage/store.py"):
        text = (ROOT / name).read_text(encoding="utf-8")
        assert "store.md" in text, f"{name} does not point to docs/store.md"
        assert "<shard_id>.parquet" not in text, f"{name} lists the layout itself"
    for name in ("README.md", "docs/design.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        assert not [t for t in sorted(tops) if f"STORE/{t}/" not in text], name
