"""A loopback server speaking OpenEnv's HTTP protocol, for tests/test_adapters_openenv.py.

    python -m tests.helpers.openenv_loopback [--port P] [--die-after N]

Routes as openenv-core's HTTPEnvServer serves them (POST /reset, POST /step, GET /state;
HTTP 422 for an action that does not fit the schema), holding one episode of a small
game: walk `target` steps (2 + seed mod 3) by saying "step"; "stay" does nothing; other
text is an invalid action (`action_valid: false` in the observation). It prints its port
on stdout once listening. `--die-after N`: the process exits, without answering, on its
N-th /step request (a server dying mid-rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

COMMANDS = ["step", "stay"]


class Game:
    def __init__(self) -> None:
        self.episode_id: str | None = None
        self.step_count = 0
        self.position = 0
        self.target = 0
        self.steps_served = 0

    def observation(self, text: str, valid: bool = True) -> dict:
        return {
            "prompt": f"{text} You are at {self.position}; the goal is at {self.target}.",
            "legal_actions": COMMANDS,
            "action_valid": valid,
        }

    def reset(self, body: dict) -> dict:
        seed = int(body.get("seed") or 0)
        self.episode_id, self.step_count = body.get("episode_id"), 0
        self.position, self.target = 0, 2 + seed % 3
        return {"observation": self.observation("Walk to the goal."), "reward": None, "done": False}

    def step(self, action: dict) -> dict:
        message = action["message"]
        self.step_count += 1
        if message.strip() == "step":
            self.position += 1
            done = self.position >= self.target
            text = "You reached the goal." if done else "You took a step."
            return {
                "observation": self.observation(text),
                "reward": 1.0 if done else 0.0,
                "done": done,
            }
        if message.strip() == "stay":
            return {"observation": self.observation("You stay."), "reward": 0.0, "done": False}
        return {
            "observation": self.observation("Unknown command.", valid=False),
            "reward": 0.0,
            "done": False,
        }

    def state(self) -> dict:
        return {
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "position": self.position,
            "target": self.target,
        }


def serve(port: int, die_after: int | None) -> None:
    game = Game()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def do_GET(self) -> None:
            if self.path == "/state":
                self._send(200, game.state())
            elif self.path == "/health":
                self._send(200, {"status": "healthy"})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/reset":
                self._send(200, game.reset(body))
            elif self.path == "/step":
                game.steps_served += 1
                if die_after is not None and game.steps_served >= die_after:
                    os._exit(1)  # mid-rollout, without an answer
                action = body.get("action")
                message = action.get("message") if isinstance(action, dict) else None
                if not isinstance(message, str) or not message.strip():
                    self._send(
                        422,
                        {
                            "detail": [
                                {
                                    "type": "string_too_short",
                                    "loc": ["body", "action", "message"],
                                    "msg": "String should have at least 1 character",
                                }
                            ]
                        },
                    )
                    return
                self._send(200, game.step(action))
            else:
                self._send(404, {"detail": "Not Found"})

    server = HTTPServer(("127.0.0.1", port), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--die-after", type=int)
    args = parser.parse_args()
    try:
        serve(args.port, args.die_after)
    except KeyboardInterrupt:
        sys.exit(0)
