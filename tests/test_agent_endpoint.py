"""Bring any agent (issue 32): `--env agent:MODULE:FUNCTION` and `--env agent+http`.

Agents written only against the `openai` package (tests/helpers/agents.py) play through the
actor's loopback endpoint into ordinary shards: G rollouts a task, valid shards, prompt ids
exactly what the policy was conditioned on (every behaviour log-prob is that of a fresh
forward pass of the version its step records), K groups in flight playing the groups of
K = 1, and an agent that raises, hangs, sends malformed messages or names another model
losing its own group only, with one line.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import ClassVar

import httpx
import polars as pl
import pytest

from gagpo.actors.actor import run_actor
from gagpo.actors.config import ActorConfig
from gagpo.actors.policies.base import Sample
from gagpo.envs import check_env, make_env
from gagpo.envs.openai_chat import RequestError, observation_key, parse_reply, read_request
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from gagpo.storage.store import Store
from tests.helpers.actors import actor_config
from tests.helpers.steps import played, steps_of
from tests.helpers.versions import fresh_logprobs, perturbed_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
G = 4
MAZE = "agent:tests.helpers.agents:maze"


def agent_config(store: Path, env: str = MAZE, **overrides) -> ActorConfig:
    """G rollouts a task, replies of at most 3 tokens (the agents here name no max_tokens),
    and the maze's tools as a Hermes block: tiny's chat template renders no tools."""
    options = {"tool_prompt": "hermes"} if env.startswith("agent") else {}
    base = {"group_size": G, "sampling": {"max_new_tokens": 3, "max_reply_tokens": 3}}
    overrides["env_options"] = options | overrides.get("env_options", {})
    return actor_config(store, env, **(base | overrides))


def test_an_openai_agent_plays_g_rollouts_into_valid_shards(tmp_path: Path):
    summary = run_actor(agent_config(tmp_path))
    assert (summary.groups, summary.rollouts, summary.groups_lost) == (3, 3 * G, 0)
    steps = steps_of(tmp_path)  # read_shard validates every shard
    assert set(steps[C.ENV]) == {MAZE} and sorted(set(steps[C.TASK_ID])) == [
        f"{MAZE}-{s}" for s in (11, 12, 13)
    ]
    rollouts = steps.group_by(C.TRAJ_ID).agg(
        pl.len().alias("turns"), pl.col(C.DONE).last().alias("done"), pl.col(C.GROUP_ID).first()
    )
    assert rollouts.group_by(C.GROUP_ID).len()["len"].to_list() == [G] * 3
    assert rollouts["turns"].max() <= 3 and rollouts["done"].all()  # the agent's 3 tries
    # A call is a step: its observation is the new messages, its state key their hash.
    first = steps.filter(pl.col(C.STEP) == 0)
    assert first[C.OBSERVATION][0].startswith("system: you are in a maze")
    assert (
        first.group_by(C.GROUP_ID).agg(pl.col(C.STATE_KEY).n_unique())[C.STATE_KEY].to_list()
        == [1] * 3
    )
    later = steps.filter(pl.col(C.STEP) > 0)
    assert set(later[C.OBSERVATION]) <= {"user: wall . go on ."}
    expected = observation_key([{"role": "user", "content": "wall . go on ."}])
    assert set(later[C.STATE_KEY]) <= {expected}
    # next_state_key is the next call's key; null after the agent ended.
    assert steps.filter(pl.col(C.DONE))[C.NEXT_STATE_KEY].null_count() == len(rollouts)
    won = steps.filter(pl.col(C.WON))
    assert (won[C.REWARD] == 1.0).all() and summary.successes == len(won)


def test_behaviour_logprobs_are_those_of_the_version_each_step_records(tmp_path: Path):
    """The prompt ids recorded are the ids the policy saw: a fresh forward pass of the
    version each step records gives its behaviour log-probs, across a version switch."""
    store_dir = tmp_path / "store"
    run_actor(agent_config(store_dir, groups=1))  # publishes v0
    store = Store(str(store_dir))
    perturbed_copy(Path(store.policies.dir(0)), Path(store.policies.dir(1)))
    store.policies.set_latest(1)
    for ref in store.list_shards():
        ref_path = Path(ref.path)
        ref_path.unlink()
    summary = run_actor(agent_config(store_dir, groups=4, groups_in_flight=2, run_id="s"))
    assert summary.versions == {0, 1}
    checked = {0: 0, 1: 0}
    for row in steps_of(store_dir).iter_rows(named=True):
        version = row[C.POLICY_VERSION]
        fresh = fresh_logprobs(
            Path(store.policies.dir(version)), row[C.PROMPT_IDS], row[C.ACTION_IDS]
        )
        assert fresh == pytest.approx(row[C.BEHAVIOR_LOGPROBS], abs=2e-4)  # test_inflight's
        checked[version] += 1
    assert checked[0] > 0 and checked[1] > 0


def test_an_environment_wrapped_as_an_agent_plays_the_native_steps(tmp_path: Path):
    """Sokoban played natively and through the endpoint by an agent that sends the native
    prompt (benchmarks/bench_agent.py): the same prompt ids, tokens, log-probs, rewards and
    ends, step for step. Only the observation column differs (the agent's is its message)."""
    wrapped = "agent:benchmarks.bench_agent:sokoban"
    for env in ("sokoban", wrapped):
        run_actor(
            agent_config(
                tmp_path / env, env=env, groups=2, group_size=2, max_turns=4, history_window=1
            )
        )
    native, agent = (played(steps_of(tmp_path / env)) for env in ("sokoban", wrapped))
    assert len(native) > 4 and native.equals(agent)


def test_what_an_agent_returns():
    from gagpo.envs.outcome import AgentError, read_outcome

    assert read_outcome(1.0, 2) == ([0.0, 1.0], True, False)
    assert read_outcome(0, 1) == ([0.0], False, False)
    assert read_outcome({"reward": 1, "turn_rewards": [0.5, -0.1]}, 2) == ([0.5, 0.9], False, False)
    assert read_outcome({"truncated": True}, 1) == ([0.0], False, True)
    for bad, says in [
        ("yes", "agent returned 'yes'"),
        ({"won": 1}, "agent returned"),
        ({"turn_rewards": [1.0]}, "1 turn_rewards for 2 calls"),
        ({"reward": float("nan")}, "not finite"),
        ({"won": True, "truncated": True}, "won and truncated"),
    ]:
        with pytest.raises(AgentError, match=says):
            read_outcome(bad, 2)


def by_task(steps: pl.DataFrame) -> pl.DataFrame:
    return (
        steps.with_columns(pl.col(C.TRAJ_ID).str.split("-").list.last().alias("j"))
        .select(C.TASK_ID, "j", C.STEP, C.STATE_KEY, C.ACTION_TEXT, C.BEHAVIOR_LOGPROBS)
        .sort(C.TASK_ID, "j", C.STEP)
    )


def test_k_groups_in_flight_play_the_groups_of_one_at_a_time(tmp_path: Path):
    one = run_actor(agent_config(tmp_path / "k1", groups=4, groups_in_flight=1))
    three = run_actor(agent_config(tmp_path / "k3", groups=4, groups_in_flight=3))
    run_actor(agent_config(tmp_path / "k3b", groups=4, groups_in_flight=3))
    assert (one.groups, three.groups, three.groups_in_flight) == (4, 4, 3)
    a, b = steps_of(tmp_path / "k1"), steps_of(tmp_path / "k3")
    for steps in (a, b):  # the same tasks (seed + k), G rollouts each
        per_task = steps.group_by(C.TASK_ID).agg(pl.col(C.TRAJ_ID).n_unique().alias("n"))
        assert sorted(per_task[C.TASK_ID]) == [f"{MAZE}-{11 + k}" for k in range(4)]
        assert per_task["n"].to_list() == [G] * 4
    first = [
        s.filter(pl.col(C.STEP) == 0)
        .group_by(C.TASK_ID)
        .agg(pl.col(C.STATE_KEY).first())
        .sort(C.TASK_ID)
        for s in (a, b)
    ]
    assert first[0].equals(first[1])  # the same first states
    assert by_task(b).equals(by_task(steps_of(tmp_path / "k3b")))  # reproducible for a K


def test_named_state_keys_and_turn_rewards(tmp_path: Path):
    run_actor(agent_config(tmp_path, env="agent:tests.helpers.agents:named_states", groups=1))
    steps = steps_of(tmp_path)
    for _, rollout in steps.group_by(C.TRAJ_ID):
        rollout = rollout.sort(C.STEP)
        assert rollout[C.STATE_KEY].to_list() == ["turn=0", "turn=1"]
        assert rollout[C.NEXT_STATE_KEY].to_list() == ["turn=1", None]
        assert rollout[C.REWARD].to_list() == [0.25, 0.5]  # turn_rewards, reward on the last
        assert rollout[C.DONE].to_list() == [False, True] and not rollout[C.WON].any()


@pytest.mark.parametrize(
    ("agent", "says"),
    [
        ("raises", "agent raised ValueError: the agent's own bug"),
        ("hangs", "did not end within 1 s"),
        ("malformed", "role None is not valid"),
        ("wrong_model", "model 'gpt-4o' is not served here"),
    ],
)
def test_a_bad_agent_loses_its_group_alone_with_one_line(tmp_path: Path, agent: str, says: str):
    warnings: list[str] = []
    config = agent_config(
        tmp_path,
        env=f"agent:tests.helpers.agents:{agent}",
        groups=4,
        groups_in_flight=2,
        env_options={"turn_timeout_s": 1},
    )
    summary = run_actor(config, warn=warnings.append)
    assert (summary.groups, summary.groups_lost) == (3, 1), warnings
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "task seed 13" in warnings[0] and says in warnings[0], warnings[0]
    tasks = set(steps_of(tmp_path)[C.TASK_ID])
    assert f"agent:tests.helpers.agents:{agent}-13" not in tasks and len(tasks) == 3


def test_the_turn_limit_truncates_and_refuses_the_next_call(tmp_path: Path):
    run_actor(agent_config(tmp_path, max_turns=2, groups=1))
    steps = steps_of(tmp_path)
    ended = steps.group_by(C.TRAJ_ID).agg(
        pl.col(C.STEP).max(),
        pl.col(C.TRUNCATED).last(),
        pl.col(C.DONE).last(),
        pl.col(C.WON).last(),
    )
    for row in ended.iter_rows(named=True):  # 2 calls, then either won or cut
        assert row[C.STEP] <= 1 and (row[C.TRUNCATED] or row[C.DONE])
        assert not (row[C.TRUNCATED] and row[C.WON])


# -- the request format -----------------------------------------------------------------


def test_requests_are_checked_and_unknown_fields_ignored():
    ok = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "frequency_penalty": 0.3,
        "seed": 4,
        "user": "x",
        "n": 1,
        "stream": False,
    }
    call = read_request(ok, model="policy", turn=0)
    assert call.observation == "user: hi" and call.state_key.startswith("obs:")
    cases = [
        ({"n": 2}, 400, "n=2 is not supported; accepted: n=1"),
        ({"stream": True}, 400, "stream=true is not supported"),
        ({"model": "gpt-4o"}, 404, "model 'gpt-4o' is not served here"),
        ({"messages": []}, 400, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role 'wizard' is not valid"),
        ({"messages": [{"role": "user"}]}, 400, "a user message needs content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "'image_url' is not supported",
        ),
        ({"temperature": "hot"}, 400, "temperature='hot' is not valid"),
        ({"max_tokens": 0}, 400, "max_tokens=0 is not valid"),
        ({"tools": [{"type": "function"}]}, 400, "tools must be a list"),
        ({"stop": ""}, 400, "stop='' is not valid"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "a list of 1 to 4 of them"),
        ({"stop": 7}, 400, "stop=7 is not valid"),
    ]
    for change, status, line in cases:
        with pytest.raises(RequestError, match=line.replace("(", r"\(")) as info:
            read_request(ok | change, model="policy", turn=0)
        assert info.value.status == status


class _Pieces:
    """A tokenizer whose ids are pieces of text (enough for cutting replies)."""

    eos_token_id = 0
    pieces: ClassVar[dict[int, str]] = {0: "", 1: "up", 2: "\n", 3: "E", 4: "ND", 5: "x"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


class _Policy:
    tokenizer = _Pieces()
    sampling = type("Sampling", (), {"max_new_tokens": 6})()


def test_stop_cuts_the_reply_after_the_token_that_completes_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}]}
    assert read_request(body | {"stop": "\n"}, model="m", turn=0).stop == ("\n",)
    assert read_request(body, model="m", turn=0).stop == ()
    sample = Sample(
        text="up\nxEND", token_ids=[1, 2, 5, 3, 4], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5]
    )
    call = read_request(body | {"stop": ["END", "\n"]}, model="m", turn=0)
    cut = call.fit(sample, _Policy())
    assert (cut.token_ids, cut.logprobs, cut.text) == ([1, 2], [-0.1, -0.2], "up\n")
    reply = call.respond([9, 9], cut, 3, _Policy())["choices"][0]
    assert (reply["message"]["content"], reply["finish_reason"]) == ("up", "stop")
    # A sequence spread over two tokens ends the reply at its second token.
    spread = read_request(body | {"stop": "END"}, model="m", turn=0).fit(sample, _Policy())
    assert (spread.token_ids, spread.text) == ([1, 2, 5, 3, 4], "up\nxEND")
    no_stop = Sample(text="upx", token_ids=[1, 5], logprobs=[-0.1, -0.3])
    assert call.fit(no_stop, _Policy()) is no_stop
    # max_tokens cuts first: a stop sequence after the cut is not reached.
    capped = read_request(body | {"stop": "END", "max_tokens": 2}, model="m", turn=0)
    assert capped.fit(sample, _Policy()).token_ids == [1, 2]


def test_the_observation_is_what_is_new_since_the_last_reply():
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0_0",
                    "type": "function",
                    "function": {"name": "move", "arguments": '{"direction": "up"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "wall"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    call = read_request({"model": "m", "messages": messages}, model="m", turn=1)
    assert call.observation == "tool: wall\n\nuser: again"
    assert call.messages[2]["tool_calls"][0]["function"]["arguments"] == {"direction": "up"}
    # The key ignores tool call ids (they differ between rollouts), not the text.
    other = [*messages[:3], {"role": "tool", "tool_call_id": "zz", "content": "wall"}, messages[4]]
    assert (
        read_request({"model": "m", "messages": other}, model="m", turn=1).state_key
        == call.state_key
    )


def test_tool_calls_are_read_from_the_templates_rendering():
    tools = ({"type": "function", "function": {"name": "move"}},)
    text = 'I will move.\n<tool_call>\n{"name": "move", "arguments": {"direction": "up"}}\n</tool_call>'
    content, calls = parse_reply(text, tools, turn=2)
    assert content == "I will move."
    assert calls == [
        {
            "id": "call_2_0",
            "type": "function",
            "function": {"name": "move", "arguments": '{"direction": "up"}'},
        }
    ]
    assert parse_reply(text, None, 0) == (text, [])  # no tools offered: plain content
    unknown = '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    assert parse_reply(unknown, tools, 0) == (unknown, [])
    assert parse_reply("<tool_call>{not json", tools, 0) == ("<tool_call>{not json", [])


class _ToolCaller:
    """The tiny policy, except that it always answers with the template's tool call."""

    REPLY = '<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>'

    def __init__(self, policy) -> None:
        self._policy = policy
        self.ids = policy.tokenizer(self.REPLY, add_special_tokens=False)["input_ids"]

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def generate(self, prompts, *, seed=None, max_tokens=None):
        return [Sample(self.REPLY, list(self.ids), [-0.5] * len(self.ids)) for _ in prompts]


def test_an_agents_tool_calls_round_trip_as_openai_tool_messages(tmp_path: Path):
    from gagpo.actors.policies.presets import load_policy

    policy = _ToolCaller(load_policy("tiny", device="cpu"))
    summary = run_actor(agent_config(tmp_path, groups=2, seed=10), policy=policy)
    steps = steps_of(tmp_path).sort(C.TRAJ_ID, C.STEP)
    # Task 10's exit is up: the first tool call wins. Task 11's is right: every call hits a
    # wall, which the agent answers with a tool message, the next turn's observation.
    assert summary.successes == G
    won = steps.filter(pl.col(C.TASK_ID).str.ends_with("-10"))
    assert won[C.STEP].max() == 0 and won[C.WON].all() and (won[C.REWARD] == 1.0).all()
    walled = steps.filter(pl.col(C.TASK_ID).str.ends_with("-11"))
    assert set(walled.filter(pl.col(C.STEP) > 0)[C.OBSERVATION]) == {"tool: wall"}
    assert walled[C.STEP].max() == 2 and not walled[C.WON].any()
    assert set(steps[C.ACTION_TEXT]) == {_ToolCaller.REPLY}


# -- agent+http ----------------------------------------------------------------------------


def _external_agent(url: str, token: str, stop: threading.Event, played: list) -> None:
    """Another process's agent, in plain HTTP: claim, call the model twice, end (each with
    the actor's token)."""
    with httpx.Client(
        trust_env=False, timeout=60, headers={"Authorization": f"Bearer {token}"}
    ) as http:
        while not stop.is_set():
            claim = http.post(f"{url}/gagpo/v1/rollouts", json={"wait_s": 0.5})
            if claim.status_code == 503:
                continue
            rollout = claim.json()
            messages = [{"role": "user", "content": f"task {rollout['task']['seed']} : go up ."}]
            for _ in range(2):
                reply = http.post(
                    f"{rollout['base_url']}/chat/completions",
                    json={"model": rollout["task"]["model"], "messages": messages},
                )
                assert reply.status_code == 200, reply.text
                messages += [
                    reply.json()["choices"][0]["message"],
                    {"role": "user", "content": "more ."},
                ]
            assert http.post(rollout["end_url"], json={"reward": 1.0, "won": True}).json() == {
                "ok": True
            }
            played.append(rollout["task"]["seed"])


def test_an_external_agent_plays_through_agent_http(tmp_path: Path):
    from gagpo.envs.endpoint import shared_endpoint

    endpoint = shared_endpoint()  # one endpoint per process: the one other tests started
    url, port = endpoint.url, int(endpoint.url.rsplit(":", 1)[1])
    stop, played = threading.Event(), []
    agents = [
        threading.Thread(target=_external_agent, args=(url, endpoint.token, stop, played))
        for _ in range(G)
    ]
    for agent in agents:
        agent.start()
    try:
        summary = run_actor(
            agent_config(tmp_path, env="agent+http", groups=2, env_options={"port": port})
        )
    finally:
        stop.set()
        for agent in agents:
            agent.join(timeout=30)
    assert (summary.groups, summary.successes) == (2, 2 * G)
    assert sorted(played) == [11] * G + [12] * G
    steps = steps_of(tmp_path)
    assert len(steps) == 2 * G * 2 and set(steps[C.ENV]) == {"agent+http"}
    with httpx.Client(trust_env=False) as http:
        models = http.get(f"{url}/v1/models").json()
        assert models["object"] == "list"
        gone = http.post(f"{url}/r/nope/v1/chat/completions", json={"model": "policy"})
        assert gone.status_code == 404 and "no open rollout" in gone.json()["error"]["message"]


# -- naming an agent ---------------------------------------------------------------------


def test_an_agent_that_cannot_be_loaded_is_one_line():
    with pytest.raises(
        GagpoError, match="agent 'nowhere_module:play' cannot be loaded: ModuleNotFoundError"
    ):
        check_env("agent:nowhere_module:play", {})
    with pytest.raises(GagpoError, match="is not an async function"):
        check_env("agent:json:dumps", {})
    with pytest.raises(GagpoError, match="accepted: MODULE:FUNCTION"):
        check_env("agent:justamodule", {})
    check_env(MAZE, {"turn_timeout_s": 5, "size": 3})  # other options go to task.options
    env = make_env(MAZE, 4, size=3)
    assert env.options == {"size": 3} and env.stop_strings == ()
    json.dumps(env.options)


@pytest.mark.slow
def test_gagpo_run_trains_an_openai_agent(tmp_path: Path):
    """The tiny recipe with the agent as its environment: published versions, valid shards
    that use several of them, and the held-out evaluation played through the agent too."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    store_dir = tmp_path / "store"
    gagpo = [sys.executable, "-m", "gagpo.workflows.cli"]
    result = subprocess.run(
        [
            *gagpo,
            "run",
            "--store",
            str(store_dir),
            "--recipe",
            "tiny",
            "--no-warmstart",
            "--set",
            f"actors.env={MAZE}",
            "--set",  # the maze agent's tools, on tiny's template (it renders none): the Hermes block
            'actors.env_options.tool_prompt="hermes"',
            "--set",  # the maze names no max_tokens: the model's context otherwise (4× the time)
            "actors.sampling.max_reply_tokens=16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    store = Store(str(store_dir))
    assert store.policies.latest() == 3 and store.quarantined() == []
    versions = set()
    for ref in store.list_shards():
        store.read_shard(ref)  # validates
        versions.update(pq.read_table(ref.path, columns=[C.POLICY_VERSION])[0].to_pylist())
    assert len(versions) >= 2, versions
    assert "held-out evaluation: the same 2 tasks" in result.stdout
