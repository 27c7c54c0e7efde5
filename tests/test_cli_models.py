"""Options generated from the config models (schemas/cli_models.py): every field of every
command's model is a flag, documented by its docstring in --help, and a `--set` key; the
flags of before still work; TOML < --set < flags, and a flag not given changes nothing."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic.fields import FieldInfo

from gagpo.actors import cli as actors_cli
from gagpo.actors.config import ActorConfig
from gagpo.learner import cli as learner_cli
from gagpo.learner.config import LearnerConfig
from gagpo.pipeline import cli as pipeline_cli
from gagpo.pipeline.config import AdvantagesCommand, EstimatorConfig
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.overrides import nested_models, parse_sets
from gagpo.workflows import warmstart_cli
from gagpo.workflows.warmstart import WarmstartConfig

# (command, its ModelOptions, the models it reads, its TOML table)
COMMANDS = {
    "actors": (actors_cli.actors_command, actors_cli.OPTIONS, (ActorConfig,), "actors"),
    "learner": (learner_cli.learner_command, learner_cli.OPTIONS, (LearnerConfig,), "learner"),
    "advantages": (
        pipeline_cli.advantages,
        pipeline_cli.OPTIONS,
        (AdvantagesCommand, EstimatorConfig),
        "advantages",
    ),
    "warmstart": (
        warmstart_cli.warmstart_command,
        warmstart_cli.OPTIONS,
        (WarmstartConfig,),
        "warmstart",
    ),
}

# Every flag the hand-written options had (tests, docs and scripts use them).
OLD_FLAGS = {
    "actors": """--store --env --policy --groups --group-size --max-turns --seed --follow
        --no-follow --throttle --no-throttle --run-id --groups-per-shard --groups-in-flight
        --env-executor --env-workers --history-window --device --threads --backend --vllm-lora
        --no-vllm-lora --vllm-gpu-memory --store-retry-seconds --expert --expert-noise
        --temperature --top-p --max-new-tokens --batch-size --config --set --quiet""",
    "learner": """--store --policy --config --mode --updates --batch-groups --max-staleness
        --mini-batches --micro-batch-tokens --lr --warmup-steps --lr-schedule --lr-final
        --weight-decay --grad-clip --temperature --estimator --bypass --no-bypass
        --behavior-cap --kl-coef --eps-low --eps-high --entropy-coef --keep-versions
        --keep-every --device --parallel --seed --poll-interval --idle-timeout --replay
        --as-of-update --resume --lora --lora-rank --lora-alpha --lora-dropout
        --lora-target-modules --precision --log-to --log-dir --set --quiet""",
    "advantages": """--input --out --store --run --estimator --gamma --lam --norm --omega --eps
        --step-std --no-step-std --gigpo-variant --state-grouping --config --compression
        --as-of-update --set --quiet --workers --ray""",
    "warmstart": """--env --policy --config --demos --noise --max-turns --history-window
        --batch-groups --lr --seed --eval-groups""",
}


def leaf_fields(model: typing.Any, prefix: str = "") -> dict[str, list[FieldInfo]]:
    """{dotted key: the field as each model (or union variant) declares it}, nested models
    walked; written here apart from the generator, to check it."""
    out: dict[str, list[FieldInfo]] = {}
    for variant in nested_models(model) or []:
        for name, info in variant.model_fields.items():
            if nested_models(info.annotation):
                for key, infos in leaf_fields(info.annotation, f"{prefix}{name}.").items():
                    out.setdefault(key, []).extend(infos)
            else:
                out.setdefault(prefix + name, []).append(info)
    return out


def fields_of(roots) -> dict[str, list[FieldInfo]]:
    return {key: infos for root in roots for key, infos in leaf_fields(root).items()}


def flag_of(key: str) -> str:
    """The naming rule of docs: dotted key with dashes; estimator.estimator is --estimator."""
    parts = key.split(".")
    if len(parts) > 1 and parts[-1] == parts[-2]:
        parts.pop()
    return "--" + "-".join(parts).replace("_", "-")


def sample(info: FieldInfo) -> tuple[list[str], typing.Any, str]:
    """(the text after the flag, the value it must become, the same as a TOML value)."""
    annotation = info.annotation
    if typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is bool:
        return [], True, "true"
    if origin is typing.Literal:
        return [str(args[-1])], args[-1], f'"{args[-1]}"'
    if origin is list and typing.get_origin(args[0]) is typing.Literal:
        values = list(typing.get_args(args[0])[:2])
        return [",".join(values)], values, repr(values)
    if origin is list:
        return ["a, b"], ["a", "b"], '["a", "b"]'
    if origin is tuple:
        return ["0.5,0.25"], (0.5, 0.25), "[0.5, 0.25]"
    if origin is dict:
        return ["{k = 1}"], {"k": 1}, "{k = 1}"
    if annotation is int:
        return ["3"], 3, "3"
    if annotation is float:
        return ["0.5"], 0.5, "0.5"
    return ["x"], "x", '"x"'


def test_every_field_has_a_docstring():
    missing = [
        f"{name}: {key}"
        for name, (_, _, roots, _) in COMMANDS.items()
        for key, infos in fields_of(roots).items()
        if not all((info.description or "").strip() for info in infos)
    ]
    assert not missing


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_field_is_a_flag_with_its_docstring_in_help(name):
    command, _, roots, _ = COMMANDS[name]
    result = CliRunner().invoke(command, ["--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    squeezed = "".join(result.output.split())  # click wraps lines anywhere between words
    opts = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for key, infos in fields_of(roots).items():
        assert flag_of(key) in opts, key
        assert any("".join(i.description.split()) in squeezed for i in infos), key
    assert set(OLD_FLAGS[name].split()) <= opts, set(OLD_FLAGS[name].split()) - opts
    for param in command.params:
        assert param.help, param.name  # every option says what it does


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_field_and_alias_reaches_its_key_through_click(name):
    command, options, roots, _ = COMMANDS[name]
    fields = fields_of(roots)
    flags = [(flag_of(key), key) for key in fields if key not in options.skip]
    flags += [(alias, key) for alias, key in options.aliases.items()]
    for flag, key in flags:
        text, value, _ = sample(fields[key][0])
        if key.endswith("estimator.estimator") or key == "estimator":
            text, value = ["gigpo"], "gigpo"
        if options.settings[key].whole:  # paths: never split at commas
            value = text
        ctx = command.make_context(name, [flag, *text])
        assert options.given(dict(ctx.params)) == {key: value}, flag
        if not text:  # a bool: its --no- form too
            ctx = command.make_context(name, [f"--no-{flag[2:]}"])
            assert options.given(dict(ctx.params)) == {key: False}, flag
    assert options.given(dict(command.make_context(name, []).params)) == {}  # nothing given


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_field_is_a_set_key(name):
    _, options, roots, section = COMMANDS[name]
    for key, infos in fields_of(roots).items():
        _, value, toml = sample(infos[0])
        parsed = parse_sets([f"{section}.{key}={toml}"], options.set_model, section)
        assert parsed.keys() == {key} and parsed[key] == (list(value) if toml[0] == "[" else value)


def test_toml_under_set_under_flags_and_absent_flags_change_nothing(tmp_path: Path):
    config = tmp_path / "actors.toml"
    config.write_text(
        '[actors]\nstore = "s"\ngroup_size = 3\nfollow = true\nenv_options = {a = 1}\n'
        "[actors.sampling]\ntop_p = 0.5\ntemperature = 0.9\n"
    )
    command, options = actors_cli.actors_command, actors_cli.OPTIONS

    def load(*args: str):
        ctx = command.make_context("actors", list(args))
        params = dict(ctx.params)
        return options.load(params.pop("config_file"), params.pop("sets"), params, section="actors")

    cfg = load("--config", str(config))
    assert (cfg.group_size, cfg.follow, cfg.sampling.top_p, cfg.sampling.temperature) == (
        3,
        True,
        0.5,
        0.9,
    )
    cfg = load(
        "--config",
        str(config),
        "--set",
        "group_size=5",
        "--set",
        "sampling.top_p=0.6",
        "--temperature",
        "0.7",
    )
    assert (cfg.group_size, cfg.sampling.top_p, cfg.sampling.temperature) == (5, 0.6, 0.7)
    assert cfg.follow and cfg.env_options == {"a": 1}  # not given on the command line: kept
    cfg = load(
        "--config",
        str(config),
        "--set",
        "group_size=5",
        "--group-size",
        "6",
        "--sampling-top-p",
        "0.7",
        "--no-follow",
    )
    assert (cfg.group_size, cfg.sampling.top_p, cfg.follow) == (6, 0.7, False)


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "actors",
            ["--group-size", "abc"],
            "config field 'group_size': Input should be a valid integer",
        ),
        ("actors", ["--env-options", "abc"], "config field 'env_options': not a TOML inline table"),
        ("learner", ["--adam-betas", "0.9"], "config field 'adam_betas'"),
        ("learner", ["--log-to", "tensorboard,nope"], "config field 'log_to'"),
        ("advantages", ["--omega", "abc"], "--omega 'abc' is not a number"),
    ],
)
def test_a_flag_that_is_not_of_its_type_is_one_line_naming_the_field(name, args, message):
    command = COMMANDS[name][0]
    result = CliRunner().invoke(command, ["--store", "s", *args])
    assert isinstance(result.exception, GagpoError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_lists_split_at_commas_except_paths():
    args = ["--input", "a,b.parquet", "--input", "c"]
    ctx = pipeline_cli.advantages.make_context("advantages", args)
    assert pipeline_cli.OPTIONS.given(dict(ctx.params)) == {"input": ["a,b.parquet", "c"]}
    ctx = learner_cli.learner_command.make_context(
        "learner", ["--lora-target-modules", "q_proj, v_proj", "--lora-target-modules", "o_proj"]
    )
    assert learner_cli.OPTIONS.given(dict(ctx.params)) == {
        "lora.target_modules": ["q_proj", "v_proj", "o_proj"]
    }
