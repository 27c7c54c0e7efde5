"""The OpenAI chat format of the agent endpoint: a request in, one turn's record and its reply out.

An agent's `chat.completions.create` call is one turn, one step (docs/environments.md,
"Bring your own agent"):

- **observation**: the messages after the conversation's last assistant message (the user
  and tool messages new since the agent's previous call; every message at the first call);
- **state key**: what the call names in `extra_body={"gagpo": {"state_key": ...}}`, else
  what the environment's `state_key` callback returns for the observation's messages,
  else a hash of them (role, name, text; never ids, which differ between rollouts);
- **prompt**: the policy's chat template applied to the messages and tools as sent, so the
  recorded `prompt_ids` are the ids the policy was conditioned on; where the messages
  begin with the rollout's previous ones and the reply it was given, unchanged, the
  previous prompt and reply ids are extended instead, never decoded and encoded again
  (actors/policies/prompt_ids.py);
- **context**: a prompt past the policy's limits is never cut: the call is answered with
  OpenAI's 400 `context_length_exceeded` (`Call.context_error`) and records no step;
- **tools**: rendered by the chat template; on a template that renders none, refused
  with a 400, or written as a Hermes tool block where the call's `tool_prompt` says so
  (envs/tool_calls.py);
- **reply budget**: the call's `max_tokens` / `max_completion_tokens` as OpenAI defines
  them, bounded by the context and the actor's `sampling.max_reply_tokens` (default: the
  model's context); a call that names none may reply up to that bound. The native
  environments' `max_new_tokens` does not apply;
- **reply**: the text as sampled; tool calls are read in the model family's own form
  (Hermes/Qwen2.5, Qwen3-Coder XML, Llama 3 JSON, Mistral; envs/tool_calls.py).

Nothing here imports a server or the `openai` package: requests are plain JSON objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gagpo.envs import bounded_json, tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint refuses: an HTTP status and one line saying what is accepted
    (with OpenAI's `code` and `param` where it has them)."""

    def __init__(
        self, status: int, line: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(line)
        self.status, self.code, self.param = status, code, param

    def payload(self) -> dict:
        """The error in OpenAI's shape, so the `openai` client raises it with this line."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


@dataclass(frozen=True)
class Call:
    """One checked chat completion request of a rollout: what the rollout loop encodes,
    records and answers (actors/rollout.py reads it as the rollout's `chat`)."""

    turn: int  # the rollout's call index, from 0
    messages: tuple[dict, ...]  # as the chat template takes them
    tools: tuple[dict, ...] | None
    observation: str
    state_key: str
    model: str
    max_tokens: int | None
    logprobs: bool
    stop: tuple[str, ...] = ()  # OpenAI's `stop`: the reply ends where one of them appears
    tool_prompt: str = "template"  # tools on a template without tools: refused, or "hermes"
    tool_parser: str = "auto"  # the tool-call format; auto: from the chat template

    def chat_for(self, tokenizer) -> tuple[tuple[dict, ...], tuple[dict, ...] | None]:
        """The messages and tools the chat template is applied to: as sent, or with the
        Hermes tool block where the template renders no tools and `tool_prompt` asks for
        it; a RequestError (400) where it renders none and it does not."""
        if not self.tools or not self.tool_block(tokenizer):
            return self.messages, self.tools
        if self.tool_prompt == "hermes":
            return tool_calls.with_tool_block(self.messages, self.tools), None
        raise RequestError(400, tool_calls.refusal_line(self.model), param="tools")

    def tool_block(self, tokenizer) -> bool:
        """Whether the call's tools need a block of their own (its template renders none)."""
        return (
            bool(self.tools)
            and hasattr(tokenizer, "apply_chat_template")
            and not tool_calls.renders_tools(tokenizer)
        )

    def reply_format(self, tokenizer) -> str:
        """The tool-call format replies are read in: the `tool_parser` option, else Hermes
        where the tools went in as a Hermes block, else the chat template's."""
        if self.tool_parser != "auto":
            return self.tool_parser
        if self.tool_block(tokenizer):
            return "hermes"
        return tool_calls.template_format(tokenizer)

    def reply_budget(self, prompt_tokens: int, policy) -> int:
        """The most tokens the reply may have: the call's max_tokens, bounded by the
        context left after the prompt and by `sampling.max_reply_tokens` (default: the
        context). A stand-in policy without a context samples its `max_new_tokens`."""
        sampling, context = policy.sampling, getattr(policy, "context", None)
        if context is None:
            cap = sampling.max_new_tokens
        else:
            ceiling = getattr(sampling, "max_reply_tokens", None) or context
            cap = max(1, min(ceiling, context - prompt_tokens))
        return min(cap, self.max_tokens) if self.max_tokens else cap

    def context_error(self, prompt_tokens: int, policy) -> RequestError | None:
        """OpenAI's 400 `context_length_exceeded` for a prompt of `prompt_tokens` past the
        policy's limits: longer than `sampling.max_prompt_tokens` where set, or leaving the
        model's context no room for the reply (`max_tokens` when asked, else one token).
        None where it fits, or where the policy says no context (a stand-in)."""
        sampling, context = getattr(policy, "sampling", None), getattr(policy, "context", None)
        if context is None:
            return None
        limit = getattr(sampling, "max_prompt_tokens", None)
        reply = self.max_tokens or 1
        if limit is not None and prompt_tokens > limit:
            line = (
                f"This endpoint's prompts are at most {limit} tokens (sampling.max_prompt_tokens). "
                f"However, your messages resulted in {prompt_tokens} tokens. Please reduce the "
                "length of the messages."
            )
        elif prompt_tokens + reply > context:
            line = (
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_tokens + reply} tokens ({prompt_tokens} in the messages, "
                f"{reply} in the completion). Please reduce the length of the messages or "
                "completion."
            )
        else:
            return None
        return RequestError(400, line, code="context_length_exceeded", param="messages")

    def answered(self, completion: dict, tokenizer=None) -> dict:
        """The assistant message of `completion` as the next call's messages hold it when
        the agent sends it back unchanged (read as `read_request` reads messages, and as
        `chat_for` writes it for the template)."""
        message = _messages([completion["choices"][0]["message"]])[0]
        if self.tool_prompt == "hermes" and self.tool_block(tokenizer):
            return tool_calls.as_text(message)
        return message

    def fit(self, sample, policy):
        """The reply cut to the call's `max_tokens`, then after the token that completes one
        of its `stop` sequences (a prefix of a sample is a sample of the shorter reply: its
        log-probs are unchanged). The recorded ids keep that token, as a backend that stops
        at a newline keeps the newline; the content answered leaves the sequence out
        (`respond`), as OpenAI does."""
        ids, logprobs = sample.token_ids, sample.logprobs
        if self.max_tokens is not None:
            ids, logprobs = ids[: self.max_tokens], logprobs[: self.max_tokens]
        decode = lambda part: policy.tokenizer.decode(part, skip_special_tokens=True)  # noqa: E731
        if self.stop and any(s in decode(ids) for s in self.stop):
            end = next(
                k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in self.stop)
            )
            ids, logprobs = ids[:end], logprobs[:end]
        if len(ids) == len(sample.token_ids):
            return sample
        return dataclasses.replace(sample, text=decode(ids), token_ids=ids, logprobs=logprobs)

    def _content(self, text: str) -> tuple[str, bool]:
        """The reply's text before its first stop sequence, and whether one ended it."""
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def respond(self, prompt: list[int], sample, version: int, policy) -> dict:
        """The OpenAI chat completion answering this call with `sample`."""
        text, stopped = self._content(sample.text)
        tokenizer = policy.tokenizer
        content, calls = parse_reply(
            text, self.tools, self.turn, self.reply_format(tokenizer), tokenizer
        )
        cap = self.reply_budget(len(prompt), policy)
        ended = sample.token_ids and sample.token_ids[-1] == tokenizer.eos_token_id
        finish = (
            "tool_calls"
            if calls
            else "length"
            if len(sample.token_ids) >= cap and not (ended or stopped)
            else "stop"
        )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
        }
        if self.logprobs:
            tokens = [tokenizer.decode([t]) for t in sample.token_ids]
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, sample.logprobs, strict=True)
                ],
                "refusal": None,
            }
        return {
            "id": f"chatcmpl-{self.turn}-{len(prompt)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(sample.token_ids),
                "total_tokens": len(prompt) + len(sample.token_ids),
            },
            "gagpo": {"policy_version": version, "step": self.turn},
        }


# -- requests --------------------------------------------------------------------------


def read_request(
    body: object,
    *,
    model: str,
    turn: int,
    key_fn: Callable[[list[dict]], str] | None = None,
    tool_prompt: str = "template",
    tool_parser: str = "auto",
) -> Call:
    """Check a chat completion request; a RequestError (4xx, one line) for what is not
    served. Unknown fields are ignored, as OpenAI does; temperature and top_p are checked
    but the actor samples with its own settings (docs/environments.md says why)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body is not a JSON object")
    asked = body.get("model")
    if asked != model:
        raise RequestError(404, f"model {asked!r} is not served here; accepted: {model!r}")
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported; accepted: stream=false")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(400, f"n={n!r} is not supported; accepted: n=1")
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            raise RequestError(
                400, f"{name}={value!r} is not valid; accepted: a number in [{low}, {high}]"
            )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise RequestError(
            400, f"max_tokens={max_tokens!r} is not valid; accepted: an integer >= 1"
        )
    asked_stop = body.get("stop")
    stop = (asked_stop,) if isinstance(asked_stop, str) else asked_stop
    if stop is not None and not (
        isinstance(stop, list | tuple)
        and 0 < len(stop) <= 4
        and all(isinstance(x, str) and x for x in stop)
    ):
        raise RequestError(
            400,
            f"stop={asked_stop!r} is not valid; accepted: a non-empty string or a list of 1 "
            "to 4 of them",
        )
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError(400, f"logprobs={logprobs!r} is not valid; accepted: true or false")
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    new = _observed(messages)
    named = body.get("gagpo") or {}
    if not isinstance(named, dict) or not isinstance(named.get("state_key", ""), str):
        raise RequestError(400, "gagpo must be an object whose state_key is a string")
    state_key = named.get("state_key") or (key_fn(new) if key_fn else observation_key(new))
    return Call(
        turn=turn,
        messages=tuple(messages),
        tools=tools,
        observation=render(new),
        state_key=state_key,
        model=model,
        max_tokens=max_tokens,
        logprobs=logprobs,
        stop=tuple(stop or ()),
        tool_prompt=tool_prompt,
        tool_parser=tool_parser,
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(content: object, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    400,
                    f"{where}: a content part of type {kind!r} is not supported; accepted: text",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(
        400,
        f"{where}: content must be a string or a list of text parts, not {type(content).__name__}",
    )


def _messages(raw: object) -> list[dict]:
    """The messages as the chat template takes them; RequestError for a malformed one."""
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "messages must be a non-empty list of message objects")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                400, f"{where}: role {role!r} is not valid; accepted: {', '.join(ROLES)}"
            )
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        if content is None and not (role == "assistant" and calls):
            raise RequestError(400, f"{where}: a {role} message needs content")
        # Templates rarely know "developer": OpenAI reads it as the system prompt.
        message: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None else _text(content, where),
        }
        if calls:
            message["tool_calls"] = _tool_calls(calls, where)
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant message's tool calls, arguments as objects (what templates render)."""
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}: tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}: each tool call needs function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str) and not arguments.strip():
            arguments = {}
        elif isinstance(arguments, str):
            try:  # bounded: a string the body's depth bound never saw (issue 46)
                arguments = bounded_json.loads(arguments)
            except bounded_json.TooDeep:
                raise RequestError(
                    400,
                    f"{where}: a tool call's arguments nest deeper than "
                    f"{bounded_json.MAX_JSON_DEPTH} levels; accepted: at most that",
                ) from None
            except ValueError:
                pass  # not JSON: kept as the agent's text
        out.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _tools(raw: object) -> tuple[dict, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in raw
    ):
        raise RequestError(
            400, 'tools must be a list of {"type": "function", "function": {"name": ...}}'
        )
    return tuple(raw) or None


def _observed(messages: list[dict]) -> list[dict]:
    """The messages after the last assistant message: what is new since the previous call."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[last + 1 :]


def render(messages: list[dict]) -> str:
    """The observation column: each message as `role: text`, blank lines between."""
    return "\n\n".join(
        f"{m['role']}{' ' + m['name'] if m.get('name') else ''}: {m['content']}" for m in messages
    )


def observation_key(messages: list[dict]) -> str:
    """The default state key: a hash of the observation's roles, names and texts."""
    canonical = json.dumps([[m["role"], m.get("name", ""), m["content"]] for m in messages])
    return "obs:" + hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()


# -- replies ---------------------------------------------------------------------------


def parse_reply(
    text: str, tools: tuple[dict, ...] | None, turn: int, fmt: str = "hermes", tokenizer=None
) -> tuple[str | None, list[dict]]:
    """The reply's content and tool calls, read in format `fmt` (envs/tool_calls.py): a
    call of a tool the request declares is a tool call (ids `call_<turn>_<i>`: the same in
    every rollout, so they never split a state); anything else stays in the content."""
    return tool_calls.parse(text, fmt, tools, turn, tokenizer)
