"""Shipped recipes and `gagpo run`: every recipe validates, its dry run prints what it printed
before (tests/data/dry_run/), `--recipe tiny` runs end to end, and SIGINT stops every
process `gagpo run` started without tearing a file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows.recipe import Recipe, load_recipe, recipe_path, shipped
from gagpo.workflows.run import run
from gagpo.workflows.warmstart import WarmstartConfig
from tests.helpers.procs import alive

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]
RECIPES = ("demo", "tiny", "sokoban", "household", "textworld", "alfworld")
DRY_RUNS = Path(__file__).parent / "data" / "dry_run"
# GAGPO_WRITE_DRY_RUN=1 rewrites the files below from the code at hand: only when a change
# of the printed plan is meant (the files hold what the dry run printed at 70524a0).
WRITE_DRY_RUN = "GAGPO_WRITE_DRY_RUN"


# Flags over a shipped recipe, each dry run in a file <recipe>--<name>.txt: --actors and
# --set reach the plan, and the warm start inherits the [actors] table as overridden.
DRY_RUN_FLAGS = {
    ("tiny", "flags"): [
        "--actors", "3",
        "--set", "actors.max_turns=7",
        "--set", "actors.sampling.top_p=0.9",
        "--set", "learner.loss.eps_low=0.1",
        "--set", "run.eval_groups=0",
    ],
    ("demo", "no-warmstart"): ["--no-warmstart", "--set", "run.eval_every=3"],
    ("gpu-alfworld", "shares"): [
        "--set", "run.actor_gpu_memory=0.3",
        "--set", "run.learner_gpus=[0,1]",
        "--set", "actors.vllm.gpu_memory_utilization=0.5",
    ],
}  # fmt: skip


def dry_run_text(recipe: str, tmp_path: Path, monkeypatch, flags=()) -> str:
    """`gagpo run --recipe RECIPE --dry-run` as printed, with what differs between machines
    and runs replaced by names: the Python, the recipes' folder, the store, the cache, the
    run id. The base policy's identity (a hash of its converted weights, built on first use:
    a minute for smollm2) is its name here, so the warm start's cache key still holds every
    setting of the recipe's [warmstart] table and what it inherits from [actors]."""
    from click.testing import CliRunner

    from gagpo.workflows import warmstart
    from gagpo.workflows.cli import gagpo

    store, cache = tmp_path / "store", tmp_path / "cache"
    monkeypatch.setenv("GAGPO_CACHE", str(cache))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the threads each process gets
    monkeypatch.setattr(warmstart, "policy_identity", lambda policy: f"name:{policy}")
    args = ["run", "--recipe", recipe, "--store", str(store), "--dry-run", *flags]
    result = CliRunner().invoke(gagpo, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = result.output
    for path, name in (
        (sys.executable, "PYTHON"),
        (str(recipe_path(recipe).parent), "RECIPES"),
        (str(store), "STORE"),
        (str(cache), "CACHE"),
    ):
        text = text.replace(path, name)
    return re.sub(r"--run-id \S+", "--run-id RUN_ID", text)


@pytest.mark.parametrize(
    ("recipe", "flags"),
    [(name, "") for name in shipped().split(", ")] + sorted(DRY_RUN_FLAGS),
)
def test_the_dry_run_of_every_shipped_recipe_prints_what_it_printed_before(
    recipe: str, flags: str, tmp_path: Path, monkeypatch
):
    text = dry_run_text(recipe, tmp_path, monkeypatch, DRY_RUN_FLAGS.get((recipe, flags), ()))
    expected = DRY_RUNS / (f"{recipe}--{flags}.txt" if flags else f"{recipe}.txt")
    if os.environ.get(WRITE_DRY_RUN):
        expected.parent.mkdir(parents=True, exist_ok=True)
        expected.write_text(text)
    assert expected.is_file(), f"no {expected}: run with {WRITE_DRY_RUN}=1 to write it"
    assert text == expected.read_text()
    assert not (tmp_path / "store").exists()  # a dry run starts nothing


def test_every_recipe_is_shipped_and_valid():
    assert set(RECIPES) <= set(shipped().split(", "))
    for name in RECIPES:
        recipe = load_recipe(name, "s")
        warm, actors = recipe.warmstart, recipe.actors
        assert warm is not None, f"recipe {name} names no warm start"
        # Demonstrations must be tokenized exactly as the RL actors present prompts.
        assert (warm.env, warm.max_turns, warm.history_window) == (
            actors.env,
            actors.max_turns,
            actors.history_window,
        )
        assert recipe.learner.policy == actors.policy == warm.policy
        assert actors.store == recipe.learner.store == "s"


def test_the_recipe_is_read_once(tmp_path: Path, monkeypatch):
    """`gagpo run` (a dry run here) parses the recipe's TOML once, whatever it checks."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(recipe_path("tiny").read_text())
    parsed = []
    loads = tomllib.loads
    monkeypatch.setattr(tomllib, "loads", lambda text: parsed.append(text) or loads(text))
    run(str(recipe), str(tmp_path / "s"), warm=False, dry_run=True, echo=lambda line: None)
    assert parsed.count(recipe.read_text()) == 1


def test_the_warm_start_inherits_the_actors_as_overridden_unless_it_sets_its_own(tmp_path):
    text = recipe_path("tiny").read_text()
    recipe = load_recipe("tiny", "s", sets=["actors.max_turns=7", "actors.env_options.size=6"])
    assert recipe.warmstart.max_turns == recipe.actors.max_turns == 7
    assert recipe.warmstart.env_options == recipe.actors.env_options == {"size": 6}
    assert recipe.warmstart.history_window == 1  # [actors]'s, not WarmstartConfig's default
    own = tmp_path / "own.toml"
    own.write_text(text.replace("[warmstart]", "[warmstart]\nhistory_window = 3\nmax_turns = 9"))
    recipe = load_recipe(own, "s", sets=["actors.max_turns=7"])
    assert (recipe.warmstart.history_window, recipe.warmstart.max_turns) == (3, 9)
    assert (recipe.actors.history_window, recipe.actors.max_turns) == (1, 7)
    # A model given as such is taken as is: nothing inherited.
    given = Recipe.model_validate(
        {**recipe.model_dump(), "warmstart": WarmstartConfig(env="household")}
    )
    assert given.warmstart.env == "household" != given.actors.env


def test_actors_and_learner_share_the_runs_store(tmp_path: Path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        recipe_path("tiny").read_text().replace("[learner]\n", '[learner]\nstore = "elsewhere"\n')
    )
    with pytest.raises(GagpoError) as err:
        load_recipe(recipe, "s")
    assert "[learner]: store = 'elsewhere', but the run's store is 's'" in str(err.value)
    assert "\n" not in str(err.value)
    assert load_recipe(recipe, "elsewhere").learner.store == "elsewhere"  # the same one: taken
    fields = load_recipe("tiny", "s").model_dump()
    fields["learner"]["store"] = "t"
    with pytest.raises(GagpoError, match="the actors write into 's' but the learner reads 't'"):
        Recipe.model_validate(fields)
    both = tmp_path / "both.toml"
    both.write_text(recipe.read_text().replace("\n[actors]\n", '\n[actors]\nstore = "s"\n'))
    with pytest.raises(GagpoError) as err:
        load_recipe(both, "s")
    assert str(err.value) == (
        f"recipe {str(both)!r}: the actors write into 's' but the learner reads 'elsewhere'; "
        "accepted: one store for both (gagpo run --store)"
    )


def test_a_wrong_value_names_its_table_and_the_set_that_gave_it():
    with pytest.raises(GagpoError) as err:
        load_recipe("tiny", "s", sets=["learner.loss.eps_low=2"])
    assert str(err.value).startswith(f"recipe {str(recipe_path('tiny'))!r} [learner] with --set: ")
    assert "config field 'loss.eps_low'" in str(err.value)
    with pytest.raises(GagpoError, match=r"\[run\]: config field 'actors'.*\(got 0\)"):
        load_recipe("tiny", "s", actors=0)


def test_the_dry_run_imports_no_torch(tmp_path: Path):
    probe = (
        "import sys; from click.testing import CliRunner; from gagpo.workflows.cli import gagpo; "
        f"args = ['run', '--store', {str(tmp_path / 's')!r}, '--dry-run']; "
        "codes = [CliRunner().invoke(gagpo, [*args, '--recipe', r, '--no-warmstart']).exit_code "
        "for r in ('gpu-alfworld', 'demo')]; "
        "print(codes, sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[0, 0] []", out.stdout + out.stderr[-2000:]


def test_the_run_opens_its_store_once(tmp_path: Path, monkeypatch):
    """Along `gagpo run`'s path (the run, its summary, the held-out evaluation, the report,
    the credit comparison) the store is opened once and passed down."""
    from gagpo.workflows.launch import LocalLauncher

    store = str(tmp_path / "s")
    opened = []
    init = Store.__init__

    def counting(self, url, *args, **kwargs):
        opened.append(str(url))
        init(self, url, *args, **kwargs)

    monkeypatch.setattr(Store, "__init__", counting)
    monkeypatch.setattr(LocalLauncher, "run", lambda self, plan: 0)
    sets = ["run.eval_groups=1", "run.report=true", "run.credit=true"]
    lines: list[str] = []
    assert run("tiny", store, warm=False, echo=lines.append, sets=sets) == 0
    assert "run summary:" in "\n".join(lines) and "credit comparison: skipped" in "\n".join(lines)
    assert opened.count(store) == 1, opened


def test_bad_warmstart_table_is_one_line(tmp_path: Path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(recipe_path("tiny").read_text().replace("noise = 0.1", "noise = 2.0"))
    result = subprocess.run(
        [*GAGPO, "run", "--store", str(tmp_path / "s"), "--recipe", str(recipe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "noise" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "s" / "shards").exists()  # nothing started


def _read_versions(store: Store) -> list[int]:
    versions = set()
    for ref in store.list_shards():
        versions.update(pq.read_table(ref.path, columns=["policy_version"])[0].to_pylist())
    return sorted(versions)


@pytest.mark.slow
def test_run_recipe_tiny_end_to_end(tmp_path: Path):
    store_dir = tmp_path / "store"
    result = subprocess.run(
        [*GAGPO, "run", "--store", str(store_dir), "--recipe", "tiny"],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    store = Store(str(store_dir))
    assert store.list_shards()
    assert list((store_dir / "advantages").glob("gagpo-*/*.parquet"))
    assert store.policies.latest() == 3
    # At least two published versions were used by later shards (v0, the warm start, and
    # newer ones the actor picked up while the learner trained).
    assert len(_read_versions(store)) >= 2, _read_versions(store)
    assert len(list((store_dir / "learner" / "metrics").glob("*.parquet"))) == 3
    # Held-out evaluation: v0, every 2nd version (kept by the learner for it) and the last,
    # on the same tasks; the rows are in the store and in the printed table.
    heldout = pq.read_table(store_dir / "eval" / "heldout.parquet").to_pydict()
    assert heldout["policy_version"] == [0, 2, 3]
    assert heldout["rollouts"] == [8, 8, 8] and len(set(heldout["task_seed"])) == 1
    assert all(0.0 <= r <= 1.0 for r in heldout["success_rate"] + heldout["valid_rate"])
    assert "held-out evaluation: the same 2 tasks × 4 rollouts for every version" in result.stdout
    assert sorted(p.name for p in (store_dir / "policy").glob("v*")) == ["v0", "v1", "v2", "v3"]
    assert (store_dir / "report" / "summary.md").is_file()
    assert "policy_version  tasks  rollouts  success_rate  95% interval" in result.stdout
    assert (
        "policy_version  rollouts  success_rate  95% interval      valid_replies" in result.stdout
    )
    assert re.search(r"held-out success: v0 [\d.]+% \[[\d.]+%, [\d.]+%\] → v3 ", result.stdout)
    assert re.search(r"groups: \d+ generated, \d+ trained, \d+ dropped as stale", result.stdout)
    assert f"report: {store_dir / 'report' / 'summary.md'}" in result.stdout
    assert "credit on this run's own" in result.stdout and "credit figure:" in result.stdout
    # The base policy is the warm start, a folder from the cache.
    assert "warm start:" in result.stdout


SLOW_RECIPE = """
[run]
actors = 2
stop_timeout_s = 60
[actors]
env = "sokoban"
policy = "tiny"
group_size = 4
max_turns = 4
[actors.sampling]
max_new_tokens = 3
[learner]
policy = "tiny"
updates = 1000
batch_groups = 1
max_staleness = 1000
lr = 1e-3
poll_interval_s = 0.2
"""


@pytest.mark.slow
def test_sigint_stops_every_process_and_tears_nothing(tmp_path: Path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(SLOW_RECIPE)
    store_dir = tmp_path / "store"
    proc = subprocess.Popen(
        [*GAGPO, "run", "--store", str(store_dir), "--recipe", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: list[int] = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        found = re.findall(r"pids? ([\d, ]+)\)", line)
        pids += [int(p) for group in found for p in group.split(",")]
        if line.startswith("learner started"):
            break
    assert len(pids) == 3, pids  # two actors and the learner
    store = Store(str(store_dir))
    while (store.policies.latest() or 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (store.policies.latest() or 0) >= 1, "the run did not train in time"
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    assert not [pid for pid in pids if alive(pid)]  # no orphan
    # Nothing torn: no temporary file left, every shard valid, LATEST complete.
    assert not [p for p in store_dir.rglob(".tmp-*")]
    for ref in store.list_shards():
        store.read_shard(ref)
    assert store.policies.has(store.policies.latest())


def test_ctrl_c_while_the_processes_start_is_no_traceback(tmp_path: Path):
    """A terminal's Ctrl-C is SIGINT to the whole process group: right after `gagpo run`
    started its actors and learner, while they still import their modules. They start
    with SIGINT held and take it back once running, so the run stops as documented
    (exit 130, 'interrupted'), no process prints a traceback and none is left. The held
    Ctrl-C is not lost: the learner stops before its first update, not after the run's
    stop timeout (an ignored one left it training for stop_timeout_s = 60 s)."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(SLOW_RECIPE)
    proc = subprocess.Popen(
        [*GAGPO, "run", "--store", str(tmp_path / "store"), "--recipe", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a shell's job
    )
    pids: list[int] = []
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        found = re.findall(r"pids? ([\d, ]+)\)", line)
        pids += [int(p) for group in found for p in group.split(",")]
        if line.startswith("learner started"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
    out = "".join(lines) + proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert len(pids) == 3 and not [pid for pid in pids if alive(pid)]
    assert "[learner] update " not in out, out[-3000:]
    assert "[learner] gagpo-learner: interrupted" in out, out[-3000:]


def test_run_prints_its_summary_when_the_learner_stops_early(tmp_path: Path, monkeypatch):
    """The learner exits 3 when its data ran out before `updates` (it says why); `gagpo run`
    still prints what ran (per-version table, group use) and returns 3. Other failures print
    no summary."""
    from gagpo.workflows import run as run_module
    from gagpo.workflows.launch import LocalLauncher

    for code, summarised in ((3, True), (1, False)):
        monkeypatch.setattr(LocalLauncher, "run", lambda self, plan, code=code: code)
        lines: list[str] = []
        store = str(tmp_path / f"s{code}")
        sets = ["run.eval_groups=0", "run.report=false"]
        assert run_module.run("tiny", store, warm=False, echo=lines.append, sets=sets) == code
        printed = "\n".join(lines)
        assert ("run summary:" in printed) == summarised, printed
        assert ("groups: 0 generated, 0 trained" in printed) == summarised
