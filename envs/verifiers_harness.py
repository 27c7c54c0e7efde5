"""An in-process chat harness for verifiers v1 (`--env verifiers:...`, envs/verifiers_env.py).

verifiers' own chat loops (`null`, `bash`) run a PEP 723 script through `uv` in a
runtime, once per segment: `uv sync` fetches the script's dependencies from the package
index, so they need the network, and every turn starts a Python process. verifiers'
harness contract allows a loop run in-process instead, as long as every model call goes
through the interception `endpoint` with its `secret` (verifiers/v1/harness.py): this is
that loop, a plain chat program without tools. Each segment is one model call on the
conversation so far (the default `resume` replays the trace's branch plus the user's
new messages), so a multi-turn environment's `interaction.turn(...)` is one turn here.

verifiers imports a harness plugin by a top-level module name (`verifiers.v1.harnesses.<id>`
first, then `<id>`) and takes the `Harness` subclass its `__all__` exports; a dotted
name does not resolve, so this module is also `gagpo_chat` in `sys.modules`, the harness
id. It imports verifiers at the top; only the verifiers adapter imports it.
"""

from __future__ import annotations

import sys

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

HARNESS_ID = "gagpo_chat"
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])

__all__ = ["ChatHarness", "ChatHarnessConfig"]


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt is a message of its own
    SUPPORTS_RESUME = True  # a later segment replays the conversation (Harness.resume)
    EXECUTES_CODE = False  # no tools: the model runs nothing
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ) -> ProgramResult:
        import openai

        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or ()]
        client = _client(endpoint, secret)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except openai.APIError as exc:  # the trace records the call's error; exit non-zero
            return ProgramResult(exit_code=1, stdout="", stderr=f"{type(exc).__name__}: {exc}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


_CLIENT: list = []  # one `openai` client for every segment (its connections kept alive)


def _client(endpoint: str, secret: str):
    """The shared client, aimed at this rollout's interception endpoint with its secret
    (`with_options` copies the settings, not the HTTP connection pool)."""
    import openai

    if not _CLIENT:
        _CLIENT.append(
            openai.AsyncOpenAI(
                base_url=endpoint,
                api_key=secret,
                max_retries=0,
                timeout=3600.0,
                http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
            )
        )
    return _CLIENT[0].with_options(base_url=endpoint, api_key=secret)
