"""Dotted `--set` overrides: parsed as TOML values, checked against the config models,
applied under explicit flags; bad ones are one line and exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gagpo.actors.config import ActorConfig
from gagpo.learner.config import LearnerConfig
from gagpo.pipeline.config import EstimatorConfig
from gagpo.schemas.config import load_config
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import merge, parse_sets, parse_value, split_sections


def test_values_are_read_as_toml_else_text():
    assert parse_value("0.1") == 0.1
    assert parse_value("true") is True
    assert parse_value('["q_proj", "v_proj"]') == ["q_proj", "v_proj"]
    assert parse_value("tw-cooking") == "tw-cooking"


def test_nested_sets_reach_the_models():
    sets = parse_sets(
        [
            "learner.loss.eps_low=0.1",
            "lora.rank=16",
            "lora.target_modules=['q_proj']",
            "estimator.lam=0.5",
            "log_to=['tensorboard']",
        ],
        LearnerConfig,
        "learner",
    )
    cfg = load_config(LearnerConfig, overrides=merge(sets, {"store": "s", "lora.rank": None}))
    assert cfg.loss.eps_low == 0.1 and cfg.lora.rank == 16
    assert cfg.lora.target_modules == ["q_proj"]
    assert cfg.estimator.lam == 0.5 and cfg.log_to == ["tensorboard"]
    # An explicit flag wins over --set; a flag not given (None) does not erase it.
    cfg = load_config(LearnerConfig, overrides=merge(sets, {"store": "s", "lora.rank": 4}))
    assert cfg.lora.rank == 4
    actor = parse_sets(["sampling.top_p=0.9", "env_options.challenge=tw-cooking"], ActorConfig)
    cfg = load_config(ActorConfig, overrides=actor | {"store": "s"})
    assert cfg.sampling.top_p == 0.9 and cfg.env_options == {"challenge": "tw-cooking"}
    assert parse_sets(["omega=0.3"], EstimatorConfig) == {"omega": 0.3}  # gigpo's field


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("loss.eps_lo=0.1", "unknown field 'eps_lo' in 'loss'; accepted: aggregation,"),
        ("los.eps_low=0.1", "unknown field 'los' in the settings; accepted: adam_betas,"),
        ("lr.x=1", "'lr' is a value, not a table"),
        ("loss.eps_low", "is not KEY=VALUE"),
    ],
)
def test_bad_keys_name_the_field_and_the_accepted_names(item, message):
    with pytest.raises(GagpoError, match=re.escape(message)):
        parse_sets([item], LearnerConfig, "learner")


def test_run_sets_are_split_by_table():
    assert split_sections(["learner.lr=0.1", "run.actors=1"], ("run", "actors", "learner")) == {
        "run": ["actors=1"],
        "actors": [],
        "learner": ["lr=0.1"],
    }
    with pytest.raises(GagpoError, match=r"accepted: run\.KEY=VALUE, actors\.KEY=VALUE"):
        split_sections(["lr=0.1"], ("run", "actors", "learner"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_set_values_are_one_line_and_exit_2(tmp_path):
    store = str(tmp_path / "s")
    learner = _cli("gagpo.learner.cli", "--store", store, "--set", "loss.eps_low=1.5")
    assert learner.returncode == 2
    assert learner.stderr.strip().splitlines() == [
        "gagpo-learner: error: config field 'loss.eps_low': Input should be less than 1 (got 1.5)"
    ]
    actors = _cli("gagpo.actors.cli", "--store", store, "--set", "sampling.top_q=0.9")
    assert actors.returncode == 2 and len(actors.stderr.strip().splitlines()) == 1
    assert "unknown field 'top_q' in 'sampling'; accepted: batch_size" in actors.stderr
    adv = _cli("gagpo.pipeline.cli", "--store", store, "--set", "lam=2")
    assert adv.returncode == 2 and "estimator parameter 'lam'" in adv.stderr
    assert len(adv.stderr.strip().splitlines()) == 1


def test_gagpo_run_checks_its_sets_before_starting_anything(tmp_path):
    from gagpo.workflows.run_cli import run_command

    result = CliRunner().invoke(
        run_command, ["--store", str(tmp_path / "s"), "--set", "learner.loss.ratio_level=word"]
    )
    assert result.exit_code != 0
    assert "config field 'loss.ratio_level'" in str(result.exception)
    assert "'action', 'token' or 'sequence'" in str(result.exception)
    assert not (tmp_path / "s").exists()  # no process started, nothing written


@pytest.mark.parametrize(
    ("module", "args", "field"),
    [
        ("gagpo.learner.cli", ["--eps-low", "1.5"], "loss.eps_low"),
        ("gagpo.learner.cli", ["--eps-high", "11"], "loss.eps_high"),
        ("gagpo.learner.cli", ["--entropy-coef", "-1"], "loss.entropy_coef"),
        ("gagpo.learner.cli", ["--lora-rank", "0"], "lora.rank"),
        ("gagpo.learner.cli", ["--lora-alpha", "0"], "lora.alpha"),
        ("gagpo.actors.cli", ["--top-p", "2"], "sampling.top_p"),
    ],
)
def test_nested_flags_reach_their_fields(tmp_path, module, args, field):
    import importlib

    command = getattr(
        importlib.import_module(module),
        "learner_command" if "learner" in module else "actors_command",
    )
    result = CliRunner().invoke(command, ["--store", str(tmp_path / "s"), *args])
    assert isinstance(result.exception, GagpoError)
    assert str(result.exception).startswith(f"config field '{field}':")


def test_one_set_option_serves_gagpo_run_too():
    """gagpo run's --set (TABLE.KEY over the recipe) comes from the same schemas.cli.set_option."""
    import click

    from gagpo.schemas.cli import set_option

    @click.command()
    @set_option("learner.loss.eps_low=0.1", tables=("run", "actors", "learner"), over="the recipe")
    def command(sets):
        click.echo(repr(sets))

    option = next(p for p in command.params if p.name == "sets")
    assert option.metavar == "TABLE.KEY=VALUE" and option.multiple
    assert "TABLE one of run, actors, learner" in option.help and "over the recipe" in option.help


def test_a_misspelt_key_in_a_config_file_names_the_closest_one(tmp_path):
    path = tmp_path / "actors.toml"
    path.write_text('[actors]\nstore = "s"\n[actors.sampling]\ntop_q = 0.9\n')
    with pytest.raises(GagpoError) as caught:
        load_config(ActorConfig, path, section="actors")
    assert str(caught.value) == (
        f"config file {str(path)!r} [actors.sampling]: unknown key 'top_q'; did you mean 'top_p'?"
    )


def test_a_wrong_value_in_a_config_file_is_reported_even_when_a_flag_overrides_it(tmp_path):
    path = tmp_path / "actors.toml"
    path.write_text('[actors]\nstore = "s"\ngroups_in_flight = "4"\n')
    with pytest.raises(GagpoError) as caught:
        load_config(ActorConfig, path, section="actors", overrides={"groups_in_flight": 2})
    assert str(caught.value) == (
        "config field 'groups_in_flight': Input should be a valid integer (got '4')"
    )
    # a field the file leaves to the flags is no error of the file's
    path.write_text("[actors]\ngroups_in_flight = 4\n")
    config = load_config(ActorConfig, path, section="actors", overrides={"store": "s"})
    assert config.groups_in_flight == 4 and config.store == "s"
