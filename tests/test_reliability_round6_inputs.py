"""Round 6 (issue 46), inputs: every parser of user data is bounded, a recipe cannot say
one thing and do another, and each case the round found ends in one line naming what is
wrong and what is accepted (exit 2, no traceback).

Each test here failed on the code before its fix (benchmarks/RESULTS.md, "Round 6 (issue
46)"): a RecursionError or MemoryError traceback, a FIFO read that never returned, a value
accepted and ignored, a learner that started with betas AdamW refuses, a TypeError from
inside the game, a NotADirectoryError, every run compacted for `--run ''`.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.schemas.bounded_toml import MAX_TOML_BYTES, MAX_TOML_DEPTH
from gagpo.schemas.config import read_toml
from gagpo.schemas.errors import GagpoError
from gagpo.workflows.recipe import load_recipe, shipped

DEEP = 400  # the depth the round tried: a RecursionError in tomllib


def cli(
    module: str, *args: str, cwd: Path, timeout: float = 120, cap: bool = False
) -> subprocess.CompletedProcess:
    """A command of the project in a fresh process; with `cap`, its address space capped
    at 3 GiB, so that reading /dev/zero (the code before the fix) ends in a MemoryError,
    not in the shared machine's swap."""

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=capped if cap else None,
    )


def assert_one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert all(word in lines[0] for word in words), lines[0]


def nested(depth: int) -> str:
    """An inline table `depth` levels deep: {a = {a = … 1 …}}."""
    return "{a = " * depth + "1" + "}" * depth


RECIPE = """\
[run]
actors = 1
report = false
credit = false

[actors]
env = "household"
policy = "{actors_policy}"
{actors_extra}

[learner]
updates = 2
{learner_extra}
"""


def recipe(tmp_path: Path, actors_policy="tiny", actors_extra="", learner_extra="") -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(
        RECIPE.format(
            actors_policy=actors_policy, actors_extra=actors_extra, learner_extra=learner_extra
        )
    )
    return path


# --- depth and size bounds on TOML -------------------------------------------------------
def test_a_recipe_nested_400_deep_is_one_line(tmp_path: Path):
    path = recipe(tmp_path, actors_extra=f"env_options = {{ deep = {nested(DEEP)} }}")
    done = cli(
        "gagpo.workflows.cli", "run", "--recipe", str(path), "--store", "s", "--dry-run",
        cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(done, "recipe.toml", f"deeper than {MAX_TOML_DEPTH} levels")


def test_a_config_nested_400_deep_is_one_line(tmp_path: Path):
    path = tmp_path / "learner.toml"
    path.write_text(f"[learner]\nloss = {nested(DEEP)}\n")
    done = cli("gagpo.learner.cli", "--config", str(path), "--store", "s", cwd=tmp_path)
    assert_one_line(done, "learner.toml", "deeper than")


def test_depth_is_bounded_below_the_parsers_stack_too(tmp_path: Path):
    """A document tomllib parses (dotted keys build depth without recursion) but that is
    deeper than the bound is refused alike: the code that walks it stays safe."""
    path = tmp_path / "dotted.toml"
    path.write_text("[actors]\nenv_options." + "a." * 200 + "b = 1\n")
    with pytest.raises(GagpoError, match="deeper than"):
        read_toml(path, "actors")
    shallow = tmp_path / "shallow.toml"
    shallow.write_text("[actors]\nenv_options = " + nested(MAX_TOML_DEPTH - 2) + "\n")
    assert read_toml(shallow, "actors")["env_options"]["a"]["a"]


def test_a_set_value_nested_400_deep_is_one_line(tmp_path: Path):
    done = cli(
        "gagpo.actors.cli", "--store", "s", "--set", f"env_options.x={nested(DEEP)}",
        cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(done, "deeper than")


def test_config_dev_zero_is_one_line(tmp_path: Path):
    done = cli("gagpo.learner.cli", "--config", "/dev/zero", "--store", "s", cwd=tmp_path, cap=True)
    assert_one_line(done, "'/dev/zero' is not a regular file", "accepted: a TOML file")


def test_recipe_dev_zero_is_named_for_what_it_is(tmp_path: Path):
    with pytest.raises(GagpoError, match="recipe '/dev/zero' is not a regular file"):
        load_recipe("/dev/zero", str(tmp_path / "store"))


def test_config_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    done = cli("gagpo.actors.cli", "--config", str(fifo), "--store", "s", cwd=tmp_path, timeout=60)
    assert_one_line(done, "is not a regular file")


def test_config_larger_than_the_cap_is_refused(tmp_path: Path):
    path = tmp_path / "big.toml"
    path.write_text('[learner]\nlog_dir = "' + "x" * MAX_TOML_BYTES + '"\n')
    with pytest.raises(GagpoError, match="holds more than 1 MiB"):
        read_toml(path, "learner")


# --- a recipe that cannot say one thing and do another -------------------------------------
@pytest.mark.parametrize(
    "item",
    [
        "actors.store=/elsewhere",
        "learner.store=/elsewhere",
        "actors.run_id=mine",
        "actors.follow=false",
        "actors.groups=3",
    ],
)
def test_set_of_a_key_the_run_does_not_use_is_refused(tmp_path: Path, item: str):
    with pytest.raises(GagpoError, match=rf"--set {item.split('=')[0]}: gagpo run does not use"):
        load_recipe(recipe(tmp_path), str(tmp_path / "store"), sets=[item])


@pytest.mark.parametrize(
    "line", ['run_id = "mine"', "groups = 3", "follow = false"], ids=["run_id", "groups", "follow"]
)
def test_recipe_key_the_run_overrides_is_refused(tmp_path: Path, line: str):
    with pytest.raises(GagpoError, match=rf"\[actors\]: {line.split()[0]} = .*accepted: no"):
        load_recipe(recipe(tmp_path, actors_extra=line), str(tmp_path / "store"))


def test_a_learner_policy_other_than_the_actors_is_refused(tmp_path: Path):
    path = recipe(tmp_path, learner_extra='policy = "smollm2-135m"')
    with pytest.raises(GagpoError, match="actors play policy 'tiny' but the learner's is 'smol"):
        load_recipe(path, str(tmp_path / "store"))
    # the learner's default is a policy too: it must be the actors' as well
    path = recipe(tmp_path, actors_policy="smollm2-135m")
    with pytest.raises(GagpoError, match=r"learner's is 'tiny' \(the default\)"):
        load_recipe(path, str(tmp_path / "store"))
    # one policy on both sides, by the file or by --set: accepted
    both = load_recipe(path, str(tmp_path / "s"), sets=["learner.policy=smollm2-135m"])
    assert both.learner.policy == both.actors.policy == "smollm2-135m"


@pytest.mark.parametrize("table", ["actors", "learner"])
def test_device_cpu_for_a_process_on_gpus_is_refused(tmp_path: Path, table: str):
    """The run starts a process given GPUs on CUDA: a table saying cpu would be overridden."""
    gpus = "run.actor_gpus=[0]" if table == "actors" else "run.learner_gpus=[0]"
    with pytest.raises(GagpoError, match=rf"but {table}.device = 'cpu'; accepted: device"):
        load_recipe(recipe(tmp_path), str(tmp_path / "store"), sets=[gpus, f"{table}.device='cpu'"])


def test_the_run_dry_run_says_which_policy_in_one_line(tmp_path: Path):
    path = recipe(tmp_path, learner_extra='policy = "smollm2-135m"')
    done = cli(
        "gagpo.workflows.cli", "run", "--recipe", str(path), "--store", "s", "--dry-run",
        cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(done, "the same policy in [actors] and [learner]")


def test_shipped_recipes_still_load(tmp_path: Path):
    """A guard, not a round-6 case: the checks refuse no shipped recipe (llm-demo included)."""
    for name in shipped().split(", "):
        load_recipe(name, str(tmp_path / name))


# --- one-line errors for the CLI cases ---------------------------------------------------
def test_learner_adam_betas_out_of_range_is_one_line(tmp_path: Path):
    done = cli(
        "gagpo.learner.cli", "--adam-betas", "2,2", "--store", str(tmp_path / "s"),
        "--idle-timeout", "1", cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert_one_line(done, "adam_betas", "less than 1")


def test_actors_env_option_of_the_wrong_type_is_one_line(tmp_path: Path):
    done = cli(
        "gagpo.actors.cli", "--env", "sokoban", "--env-options", "{sizes = 'x'}",
        "--store", str(tmp_path / "s"), "--groups", "1", cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(done, "environment 'sokoban' option 'sizes'", "accepted: tuple[int, int]")


def test_sql_on_dev_null_is_one_line(tmp_path: Path):
    done = cli("gagpo.workflows.cli", "sql", "--store", "/dev/null", "select 1", cwd=tmp_path)
    assert_one_line(done, "store '/dev/null' is not a folder")


def test_compact_run_empty_is_refused(tmp_path: Path):
    (tmp_path / "store").mkdir()
    done = cli(
        "gagpo.workflows.cli", "compact", "--store", str(tmp_path / "store"), "--run", "",
        cwd=tmp_path,
    )  # fmt: skip
    assert_one_line(done, "--run '' is not a run id", "or no --run for every run")


@pytest.mark.parametrize(
    ("gamma", "words"),
    [(True, "is not a number"), (2, "is out of range"), (float("nan"), "is out of range")],
    ids=["bool", "above-one", "nan"],
)
def test_open_store_refuses_a_gamma_that_is_no_discount(tmp_path: Path, gamma, words):
    import gagpo

    with pytest.raises(GagpoError, match=f"gamma={gamma!r} {words}; accepted: a number in"):
        gagpo.open_store(str(tmp_path), gamma=gamma)
