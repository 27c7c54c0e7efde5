"""Issue 33 (reliability, round 4): bad Ray addresses and oversized runs are one line before
anything starts; `gagpo run` ends when every actor has failed; recipes are strict and a dry
run checks what the run checks; a user's key function and an environment library that fail
are one line naming what failed and where, and a failed recompute leaves no table."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gagpo.actors.config import ActorConfig
from gagpo.schemas.config import load_config
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from gagpo.workflows.run import RunConfig
from tests.helpers.steps import make_steps

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]
BOUND_S = 30  # a bad address or an impossible run: one line within this


def _one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def _gagpo(*args: str, env: dict | None = None, timeout: float = 120):
    start = time.monotonic()
    proc = subprocess.run([*GAGPO, *args], capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - start


def _store_with_shards(root: Path, shards: int = 3) -> Path:
    store = Store(str(root))
    for i in range(shards):
        store.write_shard(make_steps(run_id="r", shard_id=f"s{i}", groups=2), group_size=3)
    return root


# --- 1. a Ray address that does not answer ---------------------------------------------------


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
        ("nosuchhost.invalid:6379", "host 'nosuchhost.invalid' does not resolve"),
        ("127.0.0.1:99999", "is not HOST:PORT with a port in 1-65535"),
        ("headnode", "is not HOST:PORT"),
        ("ray://127.0.0.1:1", "no Ray cluster answers"),
    ],
)
def test_a_bad_ray_address_is_refused_by_the_probe(address, said):
    from gagpo.pipeline.parallel import probe_address

    start = time.monotonic()
    with pytest.raises(GagpoError, match=said) as err:
        probe_address(address)
    assert time.monotonic() - start < BOUND_S
    assert "accepted: --ray auto" in str(err.value)


def test_a_port_that_is_not_a_ray_head_is_refused(monkeypatch):
    """Something listens (a typo'd port of another service) but does not speak gRPC."""
    from gagpo.pipeline import parallel

    monkeypatch.setattr(parallel, "PROBE_TIMEOUT_S", 0.5)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True)
    accepting.start()
    try:
        with pytest.raises(GagpoError, match=r"something listens at .* not a Ray cluster"):
            parallel.probe_address(f"127.0.0.1:{port}")
    finally:
        for s in held:
            s.close()
        server.close()


def test_bad_ray_addresses_end_each_command_within_the_bound(tmp_path):
    """As a user types them: gagpo run (with and without --dry-run) and gagpo advantages
    --ray. Each is one line and exit 2 within the bound; nothing is created."""
    pytest.importorskip("ray")
    store = _store_with_shards(tmp_path / "S")
    cases = [
        ("run", "--recipe", "tiny", "--store", str(tmp_path / "run"), "--ray", "127.0.0.1:1"),
        (
            "run",
            "--recipe",
            "tiny",
            "--store",
            str(tmp_path / "run"),
            "--ray",
            "nosuchhost.invalid:6379",
            "--dry-run",
        ),
        ("run", "--recipe", "tiny", "--store", str(tmp_path / "run"), "--ray", "127.0.0.1:99999"),
        ("advantages", "--store", str(store), "--workers", "2", "--ray", "127.0.0.1:1"),
    ]
    for args in cases:
        proc, took = _gagpo(*args, timeout=BOUND_S + 60)
        err = _one_line_exit_2(proc)
        assert took < BOUND_S, (args, took)
        assert "--ray '" in err, err
    assert not (tmp_path / "run").exists()
    assert not (store / "advantages").exists()


def test_a_join_that_never_completes_ends_with_one_line():
    """Past the probe, ray.init may still wait on a head that never accepts the driver (in
    native code no signal interrupts): the bound ends the process with one line, exit 2."""
    code = (
        "import time\nfrom gagpo.pipeline import parallel\nparallel.JOIN_TIMEOUT_S = 0.5\n"
        "with parallel._bounded_join('10.0.0.1:6379'):\n    time.sleep(60)\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < BOUND_S
    err = _one_line_exit_2(proc)
    assert "did not accept this driver within 0.5 s" in err


# --- 2. a run larger than the cluster ---------------------------------------------------------


def test_more_cpus_than_a_local_instance_has_are_refused(monkeypatch):
    from gagpo.workflows import ray_run
    from tests.helpers.plans import plan_for

    monkeypatch.setattr(ray_run, "local_cpus", lambda: 2)
    plan = plan_for("tiny", "run.actors=64", gpus_visible=None)
    config = load_config(RunConfig, overrides={"actors": 64})
    with pytest.raises(
        GagpoError,
        match=r"needs 65 CPU\(s\) \(actors: 64, learner: 1\); this "
        r"machine .* has 2 CPU\(s\).*accepted: fewer actors",
    ):
        ray_run.check_on_ray(plan, config, None)
    ray_run.check_on_ray(plan_for("tiny", gpus_visible=None), load_config(RunConfig), None)


def test_an_oversized_run_on_ray_starts_nothing(tmp_path):
    """run.actors = 64 with --ray alone: refused in one line before Ray or a process starts."""
    pytest.importorskip("ray")
    if (os.cpu_count() or 1) >= 65:
        pytest.skip("this machine holds 65 processes")
    ray_tmp = tmp_path / "ray"
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    proc, took = _gagpo(
        "run",
        "--recipe",
        "tiny",
        "--store",
        str(tmp_path / "s"),
        "--ray",
        "--no-warmstart",
        "--set",
        "run.actors=64",
        env=env,
    )
    err = _one_line_exit_2(proc)
    assert "needs 65 CPU(s)" in err and took < BOUND_S
    assert not ray_tmp.exists() and not (tmp_path / "s").exists()


# --- 3. gagpo run when every actor has failed --------------------------------------------------


def test_the_run_stops_when_every_actor_has_failed():
    """The learner would wait for data (or v0) forever: the run stops it and says why, with
    the actors' own line."""
    from gagpo.workflows.launch import LocalLauncher
    from gagpo.workflows.layout import Plan, Process

    fail = [
        sys.executable,
        "-c",
        "import sys; print('gagpo-actors: error: unknown environment'); sys.exit(2)",
    ]
    wait = [sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(300)"]
    plan = Plan([Process("actor 0", fail), Process("actor 1", fail), Process("learner", wait)])
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(GagpoError) as err:
        LocalLauncher(RunConfig(stop_timeout_s=10), lines.append).run(plan)
    assert time.monotonic() - start < BOUND_S
    assert str(err.value) == (
        "every actor exited with an error, so the learner was stopped; actor 0, actor 1 "
        "exited with 2: gagpo-actors: error: unknown environment"
    )
    started = next(line for line in lines if line.startswith("learner started"))
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(started.split()[-1].rstrip(")")), 0)


def test_the_wait_for_the_base_policy_says_so_and_ends(tmp_path, monkeypatch):
    from gagpo.learner import model

    monkeypatch.setattr(model, "WAIT_NOTE_S", 0.1)
    lines: list[str] = []
    with pytest.raises(GagpoError, match=r"did not appear within 0\.5s"):
        model.resolve_policy(
            "tiny", Store(str(tmp_path / "s")), poll_s=0.05, wait_s=0.5, echo=lines.append
        )
    assert lines[0].startswith("waiting for the actors to publish base policy 'tiny'")
    notes = [line for line in lines if line.startswith("still waiting")]
    assert notes and "0.5 s at most" in notes[0] and "gagpo-actors --policy tiny" in notes[0]


BROKEN_TEXTARENA = 'd = {"k": 1}\nx = f"{d["k"]}"\n'  # valid from Python 3.12 only


def test_a_run_whose_actors_fail_ends_with_their_line(tmp_path):
    """`--env textarena/…` where the library fails to import (a SyntaxError under 3.11):
    the actor says so in one line, and gagpo run ends with that line and exit 2 instead of
    a learner waiting for v0 forever."""
    if sys.version_info >= (3, 12):
        pytest.skip("the stand-in library imports from Python 3.12 on")
    (tmp_path / "lib" / "textarena").mkdir(parents=True)
    (tmp_path / "lib" / "textarena" / "__init__.py").write_text(BROKEN_TEXTARENA)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "OMP_NUM_THREADS": "1"}
    proc, _ = _gagpo(
        "run",
        "--recipe",
        "tiny",
        "--store",
        str(tmp_path / "s"),
        "--no-warmstart",
        "--set",
        "actors.env=textarena/Chess-v0",
        env=env,
        timeout=300,
    )
    err = _one_line_exit_2(proc)
    assert err.startswith("gagpo: error: every actor exited with an error"), err
    assert "'textarena' is installed but fails to import" in err and "SyntaxError" in err
    assert "[actor 0] gagpo-actors: error: the Python module 'textarena'" in proc.stdout
    assert "Traceback" not in proc.stdout


def test_a_process_a_ray_host_starts_can_be_stopped_with_sigint():
    """Ray starts its workers with SIGINT blocked, and the mask survives exec: the learner a
    host starts must get SIGINT back, or `gagpo run --ray` cannot stop it between updates."""
    from gagpo.workflows.child import die_with_parent

    probe = [
        sys.executable,
        "-c",
        "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))",
    ]
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout
        unblocked = subprocess.run(
            probe, capture_output=True, text=True, timeout=60, preexec_fn=die_with_parent
        ).stdout
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert (inherited.strip(), unblocked.strip()) == ("True", "False")


@pytest.mark.slow
def test_sigterm_stops_a_local_run_as_ctrl_c_does(tmp_path):
    """SIGTERM to `gagpo run` (no Ray): exit 130 and the closing line of an interrupted run;
    the learner and the actors it started are stopped and reaped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            *GAGPO,
            "run",
            "--recipe",
            "tiny",
            "--store",
            str(tmp_path / "s"),
            "--no-warmstart",
            "--set",
            "learner.updates=30",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("learner started"):
            break
    time.sleep(3.0)
    proc.send_signal(signal.SIGTERM)
    lines += proc.stdout.read().splitlines()
    assert proc.wait(timeout=180) == 130, "\n".join(lines[-30:])
    out = "\n".join(lines)
    assert "interrupted: every process started was stopped" in out and "Traceback" not in out
    pids = re.findall(r"pids? ([\d, ]+)\)", out)
    started = {int(pid) for found in pids for pid in found.split(", ")}
    assert len(started) == 2  # an actor and the learner
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- 4. strict recipes; --dry-run checks what the run checks ---------------------------------


def _recipe(tmp_path: Path, name: str, edit) -> str:
    from gagpo.workflows.run import recipe_path

    path = tmp_path / f"{name}.toml"
    path.write_text(edit(recipe_path("tiny").read_text()))
    return str(path)


def _without_table(text: str, table: str) -> str:
    kept, skip = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skip = line.split("]")[0].strip("[").split(".")[0] == table
        if not skip:
            kept.append(line)
    return "\n".join(kept) + "\n"


RECIPE_CASES = {
    "empty": (lambda t: "", "has no [run] table"),
    "actors-true": (
        lambda t: t.replace("actors = 1", "actors = true"),
        "[run]: config field 'actors': Input should be a valid integer (got True)",
    ),
    "bogus": (
        lambda t: t + "\n[bogus]\nx = 1\n",
        "unknown table [bogus]; accepted: [actors], [learner], [run], [warmstart]",
    ),
    "warmstrat": (
        lambda t: t.replace("[warmstart]", "[warmstrat]"),
        "unknown table [warmstrat]; did you mean [warmstart]?",
    ),
    "no-actors": (lambda t: _without_table(t, "actors"), "has no [actors] table"),
    "typo-key": (
        lambda t: t.replace("\n[run]\n", "\n[run]\nactorz = 2\n"),
        "[run]: unknown key 'actorz'; did you mean 'actors'?",
    ),
    "nested-typo": (
        lambda t: t.replace("\n[learner]\n", "\n[learner]\nloss = {eps_lo = 0.1}\n"),
        "[learner.loss]: unknown key 'eps_lo'; did you mean 'eps_low'?",
    ),
    "string-int": (
        lambda t: t.replace("\n[actors]\n", '\n[actors]\ngroups_in_flight = "4"\n'),
        "[actors]: config field 'groups_in_flight': Input should be a valid integer (got '4')",
    ),
    "gpu-id": (
        lambda t: t.replace("\n[run]\n", "\n[run]\nactor_gpus = [99999999999999999999]\n"),
        "holds GPU id 99999999999999999999, not a device index",
    ),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_bad_recipe_is_refused_before_anything_starts(tmp_path, case, dry_run):
    from gagpo.workflows.run import run

    edit, said = RECIPE_CASES[case]
    recipe = _recipe(tmp_path, case, edit)
    with pytest.raises(GagpoError) as err:
        run(recipe, str(tmp_path / "s"), warm=False, dry_run=dry_run, echo=lambda line: None)
    assert said in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("store", "sets", "said"),
    [
        ("file", (), "is a file; accepted: a folder"),
        ("file/below", (), "lies under the file"),
        ("s", ("actors.env=nope",), "unknown environment 'nope'; accepted: alfworld"),
        ("s", ("run.learner_gpus=[99999999999999999999]",), "not a device index"),
    ],
)
def test_a_dry_run_refuses_what_the_run_refuses(tmp_path, store, sets, said):
    from gagpo.workflows.run import run

    (tmp_path / "file").write_text("not a store")
    for dry_run in (True, False):
        with pytest.raises(GagpoError, match=said):
            run(
                "tiny",
                str(tmp_path / store),
                warm=False,
                dry_run=dry_run,
                sets=sets,
                echo=lambda line: None,
            )
    assert (tmp_path / "file").read_text() == "not a store" and not (tmp_path / "s").exists()


def test_the_dry_run_command_exits_2_in_one_line(tmp_path):
    recipe = _recipe(tmp_path, "warmstrat", RECIPE_CASES["warmstrat"][0])
    proc, _ = _gagpo("run", "--recipe", recipe, "--store", str(tmp_path / "s"), "--dry-run")
    assert "did you mean [warmstart]?" in _one_line_exit_2(proc)
    assert proc.stdout == ""  # no plan printed


def test_toml_strings_are_not_numbers_and_booleans_not_counts():
    with pytest.raises(GagpoError, match="groups_in_flight"):
        load_config(ActorConfig, overrides={"store": "s", "groups_in_flight": "4"})
    with pytest.raises(GagpoError, match="group_size"):
        load_config(ActorConfig, overrides={"store": "s", "group_size": True})
    cfg = load_config(ActorConfig, overrides={"store": "s", "sampling": {"temperature": 1}})
    assert cfg.sampling.temperature == 1.0  # an int still fills a float field


def test_every_shipped_recipe_passes_the_strict_checks():
    from gagpo.workflows.recipe import load_recipe, shipped

    for name in shipped().split(", "):
        load_recipe(name, "s")


# --- 5. user functions and libraries are user input ------------------------------------------


KEY_FUNCTIONS = textwrap.dedent("""
    import sys

    calls = {"n": 0}

    def raises(key):
        if key == "s1":
            raise ValueError(f"cannot read {key}\\nsecond line")
        return key

    def to_int(key):
        return 3 if key == "s1" else key

    def to_none(key):
        return None if key == "s1" else key

    def to_bytes(key):
        return key.encode() if key == "s1" else key

    def to_list(key):
        return [key] if key == "s1" else key

    def exits(key):
        if key == "s1":
            sys.exit(3)
        return key

    def none_always(key):
        return None

    def later(key):
        calls["n"] += 1
        if calls["n"] > 4:
            raise RuntimeError("fails on a later shard")
        return key
""")

GROUP = r"on group '(in|s0)-g[01]' \(state_key 's1'\)"
KINDS = {
    "raises": rf"failed {GROUP}: ValueError: cannot read s1; accepted",
    "to_int": rf"returned int 3 {GROUP}; accepted",
    "to_none": rf"returned NoneType None {GROUP}",
    "to_bytes": rf"returned bytes b's1' {GROUP}",
    "to_list": rf"returned list \['s1'\] {GROUP}",
    "exits": rf"failed {GROUP}: SystemExit: 3",
}


@pytest.fixture
def key_module(tmp_path, monkeypatch):
    """A module of key functions importable here and in spawned workers (PYTHONPATH)."""
    folder = tmp_path / "userkeys"
    folder.mkdir()
    name = f"ukeys_{tmp_path.name.replace('-', '_')}"
    (folder / f"{name}.py").write_text(KEY_FUNCTIONS)
    (folder / f"{name}_bad.py").write_text("def f(key:\n    return key\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_failing_key_function_is_one_line_naming_it_and_the_group(tmp_path, key_module, kind):
    import pyarrow.parquet as pq

    from gagpo.pipeline.config import parse_estimator_config
    from gagpo.pipeline.recompute import recompute_files

    steps = tmp_path / "steps.parquet"
    pq.write_table(make_steps(shard_id="in", groups=2), steps)
    spec = f"normalized:{key_module}:{kind}"
    config = parse_estimator_config({"estimator": "gagpo", "state_grouping": spec})
    with pytest.raises(GagpoError) as err:
        recompute_files([str(steps)], tmp_path / "out.parquet", config)
    text = str(err.value)
    assert text.startswith(f"state_grouping {spec} ") and re.search(KINDS[kind], text), text
    assert "\n" not in text
    assert not (tmp_path / "out.parquet").exists()


def test_a_key_module_with_a_syntax_error_is_one_line(tmp_path, key_module):
    from gagpo.pipeline.grouping import load_function

    with pytest.raises(GagpoError, match=r"fails to import \(SyntaxError: '\(' was never closed"):
        load_function(f"{key_module}_bad:f")


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("kind", ["raises", "exits", "to_none"])
def test_gagpo_advantages_store_with_a_failing_key_function(tmp_path, key_module, kind, workers):
    """Serial and with worker processes (a _RemoteTraceback before): one line, exit 2, and
    the failing shards are not quarantined (the data is fine; the function is not)."""
    store = _store_with_shards(tmp_path / "S")
    proc, _ = _gagpo(
        "advantages",
        "--store",
        str(store),
        "--workers",
        workers,
        "--state-grouping",
        f"normalized:{key_module}:{kind}",
    )
    err = _one_line_exit_2(proc)
    assert f"normalized:{key_module}:{kind} " in err and re.search(KINDS[kind], err), err
    assert not (store / "quarantine").exists()
    assert not list((store / "advantages").rglob("*.parquet"))


@pytest.mark.slow
def test_the_learner_with_a_failing_key_function_is_one_line(tmp_path, key_module):
    """The learner computes advantages with the same stage: the same line, exit 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = tmp_path / "S"
    actors = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.actors.cli",
            "--env",
            "sokoban",
            "--policy",
            "tiny",
            "--store",
            str(store),
            "--groups",
            "2",
            "--group-size",
            "2",
            "--max-turns",
            "3",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert actors.returncode == 0, actors.stderr[-2000:]
    spec = f"normalized:{key_module}:none_always"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagpo.learner.cli",
            "--store",
            str(store),
            "--policy",
            "tiny",
            "--updates",
            "1",
            "--set",
            "batch_groups=1",
            "--set",
            f"estimator.state_grouping={spec}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    err = _one_line_exit_2(proc)
    assert f"state_grouping {spec} returned NoneType None on group '" in err, err


def test_a_recompute_that_fails_midway_leaves_no_table(tmp_path, key_module):
    """The function fails on a later shard: the tables of the earlier shards go too; the
    tables of an earlier complete run of another tag stay."""
    from gagpo.pipeline.config import parse_estimator_config
    from gagpo.pipeline.recompute import recompute_store

    store = _store_with_shards(tmp_path / "S", shards=4)
    recompute_store(str(store), None, parse_estimator_config({"estimator": "gagpo"}))
    before = sorted((store / "advantages").rglob("*.parquet"))
    assert len(before) == 4
    spec = f"normalized:{key_module}:later"
    with pytest.raises(GagpoError, match="fails on a later shard"):
        recompute_store(
            str(store), None, parse_estimator_config({"estimator": "gagpo", "state_grouping": spec})
        )
    assert sorted((store / "advantages").rglob("*.parquet")) == before


def test_an_environment_library_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    from gagpo.envs.external import require

    (tmp_path / "brokenlib").mkdir()
    (tmp_path / "brokenlib" / "__init__.py").write_text('raise RuntimeError("needs Python 3.12")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GagpoError) as err:
        require("brokenlib", "pip install brokenlib==1.0")
    text = str(err.value)
    assert "'brokenlib' is installed but fails to import" in text
    assert "RuntimeError: needs Python 3.12" in text and "pip install brokenlib==1.0" in text
