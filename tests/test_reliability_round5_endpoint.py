"""Reliability round 5 (issue 39), the agent endpoint: what a hostile local process sends.

Bodies are bounded in size (413 once past the bound, read no further) and in JSON depth
(400), `end` checks its fields (400), agent+http's routes need the actor's token (401
without it), a failing handler answers one line, and an actor whose first group is lost
goes on. Every refusal is one line to the client and no traceback on the console.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gagpo.envs.endpoint import (
    MAX_CHAT_BYTES,
    MAX_CONTROL_BYTES,
    TOKEN_VARIABLE,
    Ended,
    Failed,
    _given_token,
    shared_endpoint,
)
from gagpo.envs.endpoint_input import MAX_JSON_DEPTH
from gagpo.schemas import columns as C
from gagpo.schemas.errors import GagpoError
from tests.helpers.actors import ACTORS
from tests.helpers.steps import steps_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def endpoint():
    return shared_endpoint()  # one per process, as an actor has


@pytest.fixture
def offered(endpoint):
    """An agent+http rollout waiting to be claimed; closed after the test."""
    rollout = endpoint.open(model="policy", task={"seed": 7})
    endpoint.offer(rollout)
    yield rollout
    endpoint.close(rollout, "the test ended")


def client(endpoint, token: str | None = "actor's") -> httpx.Client:
    """An HTTP client of `endpoint`, with its token (or `token` itself, or none)."""
    token = endpoint.token if token == "actor's" else token
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.Client(base_url=endpoint.url, trust_env=False, timeout=30, headers=headers)


def one_line_error(reply: httpx.Response, status: int, says: str) -> None:
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert says in message and "\n" not in message and "Traceback" not in reply.text, message


def claim(endpoint, offered) -> dict:
    with client(endpoint) as http:
        reply = http.post("/gagpo/v1/rollouts", json={"wait_s": 5})
    assert reply.status_code == 200, reply.text
    assert reply.json()["rollout_id"] == offered.token
    return reply.json()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# -- bounded bodies ----------------------------------------------------------------------


def test_json_nested_past_the_bound_is_a_400_of_one_line(endpoint, offered, capfd):
    chat = f"/r/{offered.token}/v1/chat/completions"
    with client(endpoint) as http:
        for path, depth in [
            (chat, 200_000),  # past the parser's recursion limit (was a 500, RecursionError)
            (chat, MAX_JSON_DEPTH + 1),  # within it, past the endpoint's bound
            ("/gagpo/v1/rollouts", 30_000),
        ]:
            reply = http.post(path, content=nested(depth))
            one_line_error(reply, 400, f"nests deeper than {MAX_JSON_DEPTH} levels")
    assert "Traceback" not in capfd.readouterr().err


def test_a_body_past_its_bound_is_a_413_and_is_not_read(endpoint, offered, capfd):
    with client(endpoint) as http:
        big = http.post("/gagpo/v1/rollouts", content=b" " * (MAX_CONTROL_BYTES + 1))
        one_line_error(big, 413, f"accepted: at most {MAX_CONTROL_BYTES} bytes")
    chat = f"/r/{offered.token}/v1/chat/completions"
    auth = f"Authorization: Bearer {endpoint.token}\r\n"
    # A body that says it is 50 MB: refused at its headers, nothing of it sent.
    status = raw_post(endpoint, chat, f"Content-Length: {50 << 20}\r\n{auth}", b"")
    assert status == 413
    # A chunked body that never says its size: refused once past the bound, though the
    # client keeps the rest back (the server read no further than the bound).
    sizes = [1 << 20] * (MAX_CHAT_BYTES >> 20) + [1024]  # the bound and 1 KiB, never ended
    chunks = b"".join(b"%x\r\n%s\r\n" % (n, b" " * n) for n in sizes)
    status = raw_post(endpoint, chat, f"Transfer-Encoding: chunked\r\n{auth}", chunks)
    assert status == 413
    assert "Traceback" not in capfd.readouterr().err


def raw_post(endpoint, path: str, headers: str, body: bytes) -> int:
    """POST with hand-made headers, send `body`, then wait for the status line without
    sending more: a server that waits for the rest of the body times out here."""
    host, port = endpoint.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}{headers}\r\n".encode() + body)
        line = sock.makefile("rb").readline()
    return int(line.split()[1])


# -- end -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"error": ""}, "error='' is not valid"),  # was a 500 (IndexError)
        ({"error": " \n"}, "is not valid; accepted: a non-empty string"),
        ({"error": 5}, "error=5 is not valid"),
        ({"reward": 1e39}, "not finite as a float32"),  # was never written nor reported
        ({"reward": -1e39, "won": False}, "not finite as a float32"),
        ({"reward": "1"}, "end got {'reward': '1'}"),
        ({"reward": 1.0, "won": "yes"}, "end got"),
        ({"turn_rewards": [1e39]}, "not finite as a float32"),
        ([1.0], "not a JSON object"),
    ],
)
def test_end_checks_its_fields(endpoint, offered, body, says, capfd):
    rollout = claim(endpoint, offered)
    with client(endpoint) as http:
        one_line_error(http.post(rollout["end_url"], json=body), 400, says)
    assert offered.events.empty()  # nothing reached the environment
    assert "Traceback" not in capfd.readouterr().err


def test_an_in_process_agents_reward_past_float32_loses_its_group():
    from gagpo.envs.outcome import AgentError, read_outcome

    assert read_outcome(3.4e38, 1) == ([3.4e38], True, False)
    for result in (1e39, {"reward": 2e38, "turn_rewards": [2e38]}):  # their sum overflows
        with pytest.raises(AgentError, match="not finite as a float32"):
            read_outcome(result, 1)


# -- the agent+http token ----------------------------------------------------------------


def test_agent_http_routes_need_the_actors_token(endpoint, offered):
    for token in (
        None,
        "x",
        "not-the-token-of-this-actor",
        endpoint.token + "x",
        endpoint.token[1:],
    ):
        with client(endpoint, token) as http:
            one_line_error(
                http.post("/gagpo/v1/rollouts", json={"wait_s": 0}), 401, "needs the actor's"
            )
    rollout = claim(endpoint, offered)
    chat = f"{rollout['base_url']}/chat/completions"
    request = {"model": "policy", "messages": [{"role": "user", "content": "go"}]}
    with client(endpoint, None) as http:
        one_line_error(http.post(chat, json=request), 401, "needs the actor's")
        one_line_error(http.post(rollout["end_url"], json={"reward": 1}), 401, "needs the actor's")
    assert offered.events.empty()
    # With the token: the call reaches the rollout and gets its answer; the end is taken.
    replies: list[httpx.Response] = []

    def call() -> None:
        with client(endpoint) as http:
            replies.append(http.post(chat, json=request))

    caller = threading.Thread(target=call)
    caller.start()
    turn = offered.events.get(timeout=10)
    assert turn.call.observation == "user: go"
    endpoint.answer(turn, {"choices": []})
    caller.join(timeout=10)
    assert replies[0].status_code == 200 and replies[0].json() == {"choices": []}
    with client(endpoint) as http:
        end = http.post(rollout["end_url"], json={"reward": 3e38, "won": True})
        assert end.json() == {"ok": True}
        assert http.post(rollout["end_url"], json={"error": "no\nmore"}).status_code == 200
    assert offered.events.get_nowait() == Ended({"reward": 3e38, "won": True})
    assert offered.events.get_nowait() == Failed("the agent gave up: no")
    # Rollouts of `agent:` and verifiers are not offered: their URL is theirs alone, and
    # their calls are checked as ever, with no token.
    own = endpoint.open(model="policy")
    try:
        with client(endpoint, None) as http:
            reply = http.post(f"/r/{own.token}/v1/chat/completions", json={"model": "x"})
        one_line_error(reply, 404, "model 'x' is not served here")
    finally:
        endpoint.close(own, "the test ended")


def test_a_token_set_in_the_environment_is_used_and_checked(monkeypatch):
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    assert _given_token() is None
    monkeypatch.setenv(TOKEN_VARIABLE, "a" * 32)
    assert _given_token() == "a" * 32
    for bad in ("short", "a" * 20 + " x", "ä" * 20):
        monkeypatch.setenv(TOKEN_VARIABLE, bad)
        with pytest.raises(GagpoError, match="is not a valid token; accepted: at least 16"):
            _given_token()


def test_a_failing_handler_answers_one_line(endpoint, monkeypatch, capfd):
    def broken(token):
        raise KeyError("a bug\nof ours")

    monkeypatch.setattr(endpoint, "models", broken)
    with client(endpoint, None) as http:
        one_line_error(http.get("/v1/models"), 500, "failed on /v1/models: KeyError")
    err = capfd.readouterr().err
    assert "failed on /v1/models: KeyError" in err and "Traceback" not in err


# -- the actor goes on ---------------------------------------------------------------------


def test_an_actor_whose_first_group_is_lost_goes_on(tmp_path: Path):
    """Task seed 13 is the first group and its agent raises: the progress line (not
    --quiet) and the summary say so, the actor plays the other groups, exits 0."""
    store = tmp_path / "store"
    result = subprocess.run(
        [
            *ACTORS,
            "--store",
            str(store),
            "--env",
            "agent:tests.helpers.agents:raises",
            "--policy",
            "tiny",
            "--groups",
            "3",
            "--group-size",
            "2",
            "--seed",
            "13",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "(task seed 13) lost: environment raised AgentError" in result.stderr
    assert "policy -" in result.stderr and "lost 1" in result.stderr  # the progress lines
    assert "2 groups" in result.stdout and "1 group(s) lost" in result.stdout
    tasks = set(steps_of(store)[C.TASK_ID])  # read_shard validates every shard
    assert tasks == {f"agent:tests.helpers.agents:raises-{seed}" for seed in (14, 15)}


def test_the_token_is_printed_once_at_the_first_agent_http_rollout():
    """An `agent:` run's log holds no secret; an agent+http run's says the token once."""
    code = (
        "import sys\n"
        "from gagpo.envs.endpoint import shared_endpoint\n"
        "e = shared_endpoint()\n"
        "e.open(model='m')\n"
        "print('OFFER', file=sys.stderr, flush=True)\n"
        "e.offer(e.open(model='m'))\n"
        "e.offer(e.open(model='m'))\n"
        "print(e.token)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    token = result.stdout.strip()
    before, after = result.stderr.split("OFFER")
    assert len(token) >= 32 and token not in before and after.count(token) == 1, result.stderr
