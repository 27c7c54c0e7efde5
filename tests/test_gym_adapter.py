"""Users' own environments: the Gymnasium-style adapter, and a package that registers an
environment through the `gagpo.envs` entry point, installed into the venv and played by
`gagpo-actors --env NAME` into valid shards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from gagpo.envs.base import Environment
from gagpo.envs.gym_adapter import GymAdapter
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.schemas.validate import validate_steps

# A text game written only against Gymnasium's interface: take the key, open the right
# door. It subclasses gymnasium.Env where gymnasium is installed, a plain class elsewhere.
KEYROOM = '''
"""A toy Gymnasium-style text environment for gagpo's tests."""
import random

try:
    from gymnasium import Env
except ImportError:
    Env = object


class KeyRoom(Env):
    metadata = {"render_modes": []}
    instructions = "Take the key, then open the right door. Reply with exactly one command."

    def __init__(self, doors=2):
        self.doors = doors

    def reset(self, *, seed=None, options=None):
        self.target = random.Random(seed).randrange(self.doors) + 1
        self.has_key = False
        return self._observation(), {**self._info(), "expert_plan": self.solution()}

    def solution(self):
        return ["take key", f"open door {self.target}"]

    def step(self, action):
        command = action.strip().lower()
        valid = command in self._commands()
        reward, terminated, won = 0.0, False, False
        if valid and command == "take key":
            self.has_key = True
        elif valid and command.startswith("open door"):
            terminated = True
            won = command == f"open door {self.target}"
            reward = 1.0 if won else 0.0
        info = {**self._info(), "won": won, "action_valid": valid}
        return self._observation(), reward, terminated, False, info

    def _commands(self):
        if not self.has_key:
            return ["take key", "look"]
        return ["look", *(f"open door {d}" for d in range(1, self.doors + 1))]

    def _observation(self):
        held = "You hold a key." if self.has_key else "A key lies on the floor."
        return f"You are in a room with {self.doors} doors. {held}"

    def _info(self):
        return {"state_key": f"key={self.has_key}", "admissible_commands": self._commands()}


def room_state(observation, info):
    return "room:" + info["state_key"]
'''

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "gagpo-test-keyroom"
version = "0.0.1"

[tool.setuptools]
py-modules = ["gagpo_keyroom_test"]

[project.entry-points."gagpo.envs"]
toy-keyroom = "gagpo_keyroom_test:KeyRoom"
toy-keyroom-broken = "gagpo_keyroom_test:NoSuchClass"
"""


def _keyroom_class():
    namespace: dict = {"__name__": "keyroom_inline"}
    exec(compile(KEYROOM, "keyroom_inline", "exec"), namespace)
    return namespace["KeyRoom"]


def room_key(observation: str, info: dict) -> str:
    """A user's state_key function, named to the adapter as "module:function"."""
    return f"fn:{info['state_key']}"


def hidden_key(observation: str, info: dict, env) -> str:
    """A state_key function that reads the environment's hidden state (it takes `env`)."""
    return f"target={env.target} key={env.has_key}"


class Lenient:
    """TextWorld-Express-like: lists admissible commands, answers anything, flags nothing."""

    def reset(self, *, seed=None):
        self.count = 0
        return "A lever.", {"state_key": "0", "admissible_commands": ["pull lever", "look"]}

    def step(self, action):
        if action == "pull lever":
            self.count += 1
        info = {"state_key": str(self.count), "admissible_commands": ["pull lever", "look"]}
        return (
            ("Clunk." if action == "pull lever" else "I don't understand."),
            0.0,
            False,
            False,
            info,
        )


class OldGym:
    """The old Gym protocol: reset returns the observation, step a 4-tuple."""

    def __init__(self, limit=3):
        self.limit = limit

    def reset(self, seed=None):
        self.t = 0
        return "start"

    def step(self, action):
        self.t += 1
        cut = self.t >= self.limit
        info = {"state_key": f"t{self.t}", "TimeLimit.truncated": cut and action != "win"}
        return f"t={self.t}", float(action == "win"), cut or action == "win", info


# -- the adapter ---------------------------------------------------------------------------


def test_adapter_maps_gymnasium_steps_to_transitions():
    env = GymAdapter(_keyroom_class()(doors=3), name="keyroom", max_turns=10)
    assert isinstance(env, Environment)
    first = env.reset(7)
    assert first.state_key == "key=False" and first.admissible == ("take key", "look")
    assert env.instructions.startswith("Take the key")
    plan = env.expert_plan()
    assert plan[0] == "take key" and plan[1].startswith("open door ")
    look = env.step("look")
    assert (look.state_key, look.next_state_key, look.reward, look.done) == (
        "key=False",
        "key=False",
        0.0,
        False,
    )
    bad = env.step("dance")
    assert not bad.action_valid  # from info["action_valid"]
    took = env.step("take key")
    assert took.next_state_key == "key=True" and "open door 1" in took.admissible
    won = env.step(plan[1])
    assert won.done and won.won and won.reward == 1.0
    assert won.next_state_key is None and won.admissible == ()


def test_adapter_loses_truncates_and_resets_deterministically():
    env = GymAdapter(_keyroom_class()(doors=3), name="keyroom", max_turns=2)
    env.reset(1)
    wrong = next(d for d in (1, 2, 3) if f"open door {d}" != env.expert_plan()[1])
    env.step("take key")
    lost = env.step(f"open door {wrong}")
    assert lost.done and not lost.won and lost.reward == 0.0
    env.reset(1)
    env.step("look")
    cut = env.step("look")  # the turn limit: truncated, not done, not won
    assert cut.truncated and not cut.done and not cut.won and cut.next_state_key == "key=False"
    twins = [GymAdapter(_keyroom_class()(doors=9), name="k", max_turns=5) for _ in range(2)]
    assert twins[0].reset(4) == twins[1].reset(4)  # the seed reaches the environment
    assert twins[0].expert_plan() == twins[1].expert_plan()


def test_real_gymnasium_env_and_wrapper_truncation():
    gymnasium = pytest.importorskip("gymnasium")
    keyroom = _keyroom_class()
    assert issubclass(keyroom, gymnasium.Env)
    limited = gymnasium.wrappers.TimeLimit(keyroom(), max_episode_steps=2)
    env = GymAdapter(limited, name="k", max_turns=50)
    assert env.reset(3).state_key == "key=False"
    assert env.expert_plan()[0] == "take key"  # from info, through the wrapper
    assert not env.step("look").truncated
    cut = env.step("look")  # the wrapper's truncation, well before max_turns
    assert cut.truncated and not cut.done and cut.next_state_key == "key=False"


def test_state_key_from_a_named_function_or_the_observation():
    by_fn = GymAdapter(_keyroom_class()(), name="k", max_turns=5, state_key=f"{__name__}:room_key")
    assert by_fn.reset(0).state_key == "fn:key=False"
    by_obs = GymAdapter(_keyroom_class()(), name="k", max_turns=5, state_key="observation")
    first = by_obs.reset(0)
    assert first.state_key == first.observation


def test_adapter_errors_are_one_clear_line():
    with pytest.raises(GagpoError, match="gives no 'room' in info; accepted: name an info key"):
        GymAdapter(_keyroom_class()(), name="k", max_turns=5, state_key="room").reset(0)
    with pytest.raises(GagpoError, match="state_key function 'no_such_module:f' cannot be loaded"):
        GymAdapter(_keyroom_class()(), name="k", max_turns=5, state_key="no_such_module:f")
    with pytest.raises(GagpoError, match="has no reset\\(\\) method"):
        GymAdapter(object(), name="k", max_turns=5)

    class Pixels:
        def reset(self, *, seed=None):
            return [0, 1], {"state_key": "s"}

        def step(self, action):
            raise AssertionError("not reached")

    with pytest.raises(GagpoError, match="returned a list observation; accepted: text"):
        GymAdapter(Pixels(), name="pixels", max_turns=5).reset(0)


def test_a_reply_outside_the_admissible_commands_is_invalid():
    env = GymAdapter(Lenient(), name="lenient", max_turns=10)
    env.reset(0)
    odd = env.step("dance")  # the environment said nothing; the list it gave decides
    assert not odd.action_valid and odd.observation == "I don't understand."
    pulled = env.step("Pull the Lever.")  # matched to "pull lever", sent in its spelling
    assert pulled.action_valid and pulled.observation == "Clunk." and pulled.next_state_key == "1"


def test_validity_from_a_named_info_key():
    class Flags(Lenient):
        def step(self, action):
            obs, r, term, trunc, info = super().step(action)
            return obs, r, term, trunc, {**info, "ok": action == "pull lever"}

    env = GymAdapter(Flags(), name="flags", max_turns=10, valid_key="ok", admissible_key="none")
    env.reset(0)
    assert not env.step("look").action_valid  # info["ok"] is false; no list is consulted
    assert env.step("pull lever").action_valid


def test_old_gym_four_tuple_steps_are_accepted_and_other_shapes_are_one_line():
    env = GymAdapter(OldGym(limit=3), name="old", max_turns=10, state_key="observation")
    assert env.reset(0).observation == "start"
    assert not env.step("wait").done
    won = env.step("win")
    assert won.done and not won.truncated and won.reward == 1.0
    env.reset(0)
    env.step("wait"), env.step("wait")
    cut = env.step("wait")  # done with TimeLimit.truncated: a truncation, as old Gym meant
    assert cut.truncated and not cut.done

    class Triple(OldGym):
        def step(self, action):
            return "x", 0.0, False

    bad = GymAdapter(Triple(), name="triple", max_turns=10, state_key="observation")
    bad.reset(0)
    with pytest.raises(GagpoError) as exc:
        bad.step("wait")
    assert str(exc.value) == (
        "environment 'triple': step() returned a tuple of 3; accepted: (observation, reward, "
        "terminated, truncated, info) or old Gym's (observation, reward, done, info)"
    )


def test_a_reset_that_reports_a_broken_environment_is_refused():
    class Uninitialised(OldGym):
        def reset(self, seed=None):  # what TextWorld-Express says without a game generator
            return "ERROR: Game generator is not initialized", {"state_key": "-"}

    with pytest.raises(GagpoError) as exc:
        GymAdapter(Uninitialised(), name="twx", max_turns=5).reset(3)
    assert str(exc.value) == (
        "environment 'twx' reports it is broken at reset (seed 3): "
        "ERROR: Game generator is not initialized"
    )

    class Flagged(OldGym):
        def reset(self, seed=None):
            return "Welcome.", {"state_key": "-", "error": "no such task 'x'"}

    with pytest.raises(GagpoError, match="broken at reset \\(seed 0\\): no such task 'x'"):
        GymAdapter(Flagged(), name="f", max_turns=5).reset(0)
    # error_prefix="" turns the observation check off
    GymAdapter(Uninitialised(), name="twx", max_turns=5, error_prefix="").reset(3)


def test_a_state_key_function_may_take_the_environment():
    env = GymAdapter(
        _keyroom_class()(doors=5), name="k", max_turns=5, state_key=f"{__name__}:hidden_key"
    )
    first = env.reset(2)
    assert first.state_key == f"target={env.env.target} key=False"


def test_one_adapter_reset_per_rollout_restores_each_seed():
    env = GymAdapter(
        _keyroom_class()(doors=9), name="k", max_turns=5, state_key=f"{__name__}:hidden_key"
    )
    a = env.reset(1)
    plan_a = env.expert_plan()
    env.step("take key")
    b = env.reset(2)
    env.step("take key")
    again = env.reset(1)
    assert (again.observation, again.state_key) == (a.observation, a.state_key)
    assert env.expert_plan() == plan_a and b.state_key != a.state_key


# -- an environment from another package, through the entry point ---------------------------


@pytest.fixture(scope="module")
def keyroom_package(tmp_path_factory):
    """Install the KeyRoom package into this venv (no network: no deps, no build isolation);
    uninstall it afterwards."""
    src = tmp_path_factory.mktemp("keyroom-src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "gagpo_keyroom_test.py").write_text(KEYROOM)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    try:
        yield "toy-keyroom"
    finally:
        subprocess.run([*pip, "uninstall", "-y", "gagpo-test-keyroom"], capture_output=True)


ACTORS = [sys.executable, "-m", "gagpo.actors.cli", "--quiet"]

_PROBE = """
import json
import shutil
from gagpo.envs import environment_names, make_env
from gagpo.schemas.errors import GagpoError
out = {"names": environment_names()}
env = make_env("toy-keyroom", 4, doors=3, state_key="gagpo_keyroom_test:room_state")
first = env.reset(2)
out["key"] = first.state_key
out["plan"] = env.expert_plan()
out["won"] = [env.step(c).won for c in env.expert_plan()]
try:
    make_env("toy-keyroom", 4, colour="red")
except GagpoError as exc:
    out["unknown_option"] = str(exc)
print(json.dumps(out))
"""


def test_entry_point_environment_is_found_and_configured(keyroom_package):
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert {"toy-keyroom", "toy-keyroom-broken", "webshop", "sokoban"} <= set(out["names"])
    assert out["key"] == "room:key=False"  # the user's function, named "module:function"
    assert out["plan"][0] == "take key" and out["won"] == [False, True]
    assert out["unknown_option"] == (
        "environment 'toy-keyroom' takes no option 'colour'; accepted: doors, state_key, "
        "admissible_key, won_key, expert_key, valid_key, error_key, error_prefix, instructions"
    )
    listed = subprocess.run([*ACTORS, "--help"], capture_output=True, text=True, timeout=120)
    assert "toy-keyroom" in listed.stdout


def test_gagpo_actors_plays_an_entry_point_environment_into_valid_shards(
    keyroom_package, store_dir: Path
):
    G = 3
    result = subprocess.run(
        [
            *ACTORS,
            *("--store", str(store_dir), "--env", keyroom_package, "--policy", "tiny"),
            *("--groups", "2", "--group-size", str(G), "--max-turns", "3", "--seed", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    shards = sorted(store_dir.glob("shards/run=*/*.parquet"))
    assert len(shards) == 2
    for path in shards:
        table = pq.read_table(path)
        validate_steps(table, table.schema.metadata)
    steps = pl.read_parquet(shards)
    assert steps[C.ENV].unique().to_list() == [keyroom_package]
    assert steps[C.TRAJ_ID].n_unique() == 2 * G
    assert set(steps[C.STATE_KEY].unique()) <= {"key=False", "key=True"}  # from info
    assert (steps.filter(pl.col(C.STEP) == 0)[C.STATE_KEY] == "key=False").all()
    assert steps.filter(pl.col(C.WON))[C.DONE].all()  # won only on a terminating step


def test_broken_entry_point_is_one_line_and_exit_2(keyroom_package, store_dir: Path):
    result = subprocess.run(
        [*ACTORS, "--store", str(store_dir), "--env", "toy-keyroom-broken"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert (
        "environment 'toy-keyroom-broken' (entry point 'gagpo_keyroom_test:NoSuchClass'" in lines[0]
    )
    assert "cannot be loaded: AttributeError" in lines[0]


# -- a real old-protocol library: TextWorld-Express (Java) --------------------------------


@pytest.mark.slow
def test_textworld_express_through_the_adapter():
    """TextWorld-Express 1.1.0 as the issue met it: its reset without load() answers
    "ERROR: Game generator is not initialized" (refused here in one line), its step is old
    Gym's 4-tuple (accepted), and it answers any text while listing validActions (a reply
    outside them is invalid)."""
    twx = pytest.importorskip("textworld_express", reason="make install installs it")
    if shutil.which("java") is None:
        pytest.skip("TextWorld-Express needs Java")
    raw = twx.TextWorldExpressEnv(envStepLimit=100)
    try:
        with pytest.raises(GagpoError) as exc:
            GymAdapter(raw, name="twx", max_turns=20, state_key="observation").reset(0)
        assert "\n" not in str(exc.value)
        assert str(exc.value).startswith(
            "environment 'twx' reports it is broken at reset (seed 0): "
            "ERROR: Game generator is not initialized"
        )
        raw.load(gameName="twc", gameParams="numLocations=1,includeDoors=0,numItemsToPutAway=1")
        raw.reset(seed=0, gameFold="train", generateGoldPath=True)
        plan = raw.getGoldActionSequence()
        env = GymAdapter(
            raw,
            name="twx",
            max_turns=20,
            state_key="observation",
            admissible_key="validActions",
            won_key="tasksuccess",
        )
        first = env.reset(0)
        assert first.admissible and plan[0] in first.admissible
        odd = env.step("dance")
        assert not odd.action_valid and not odd.done  # TWX: "Unknown action", flags nothing
        steps = [env.step(command) for command in plan]
        assert all(t.action_valid for t in steps)
        assert steps[-1].done and steps[-1].won and not any(t.won for t in steps[:-1])
        again = env.reset(0)  # reset per rollout: the same start
        assert (again.observation, again.admissible) == (first.observation, first.admissible)
    finally:
        raw.close()
