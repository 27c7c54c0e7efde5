"""Tools the model can see, and the tool calls it writes, in each model family's own form.

**Tools in.** An agent's `tools` reach the model through its chat template. Some templates
render none (SmolLM2's, and the tiny preset's): the tools would vanish without a word.
`tool_prompt` (an option of `agent:` and `agent+http`) says what happens then:

- `"template"` (the default): the call is refused with a 400 that says so and names the
  remedy (`tool_prompt = "hermes"`, or a model whose template renders tools);
- `"hermes"`: the tools are written into the system message as a tool block in the
  Hermes form (`hermes_block`, the wording Hermes 2 Pro and Qwen2.5 are trained on), and
  the assistant turns that called tools are written as `<tool_call>` text (`as_text`), so
  the template renders the whole conversation; the recorded `prompt_ids` are that
  rendering, exactly what the model saw. Replies are then read in the Hermes form.

**Tool calls out** (`parse`), by format, chosen from the chat template
(`template_format`) unless `tool_parser` names one:

| format        | what the model writes                                              |
|---------------|--------------------------------------------------------------------|
| `hermes`      | `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes, Qwen2.5, Qwen3) |
| `qwen3_coder` | `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` |
| `llama3_json` | the reply is `{"name": …, "parameters": {…}}` (`<|python_tag|>` optional) |
| `mistral`     | `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`                    |

A tokenizer that carries a `response_template` (transformers' response parsing) is read
with `tokenizer.parse_response` first. A call that names no declared tool, or that does
not parse, stays in the reply's text (its finish reason unchanged): the agent sees what the
model wrote. JSON in a reply is parsed with the depth bound of envs/bounded_json.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gagpo.envs import bounded_json

FORMATS = ("hermes", "qwen3_coder", "llama3_json", "mistral")
PARSERS = ("auto", *FORMATS)
TOOL_PROMPTS = ("template", "hermes")

_PROBE = "gagpo_probe_tool_5f2a"
_RENDERS: dict[str, bool] = {}  # chat template text -> does it render tools

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_CODER = re.compile(
    r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL
)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_MISTRAL = re.compile(r"^\s*(?:\[TOOL_CALLS\])?\s*(\[.*\])\s*$", re.DOTALL)


# -- tools in ---------------------------------------------------------------------------


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given (a probe tool's
    name appears in its rendering)."""
    template = _template_text(tokenizer)
    if template not in _RENDERS:
        probe = {
            "type": "function",
            "function": {"name": _PROBE, "parameters": {"type": "object", "properties": {}}},
        }
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}],
                tools=[probe],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception:  # a template that fails on tools renders none
            text = ""
        _RENDERS[template] = _PROBE in text
    return _RENDERS[template]


def refusal_line(model: str) -> str:
    """The 400 of a call with tools on a template that renders none."""
    return (
        f"the chat template of the policy serving {model!r} renders no tools: the call's "
        "tools would never reach "
        'the model; accepted: the agent environment\'s option tool_prompt = "hermes" (a '
        "system-prompt tool block in the Hermes form, recorded in prompt_ids), or a policy "
        "whose chat template renders tools"
    )


def hermes_block(tools: tuple[dict, ...]) -> str:
    """The tools as a system-prompt block in the Hermes form."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def as_text(message: dict) -> dict:
    """An assistant message that called tools, its calls written as `<tool_call>` text
    (what a template without tools then renders); any other message unchanged."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            ensure_ascii=False,
        )
        + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def with_tool_block(messages: tuple[dict, ...], tools: tuple[dict, ...]) -> tuple[dict, ...]:
    """`messages` for a template without tools: the Hermes tool block appended to the
    system message (one is added first where there is none), tool calls as text."""
    block = hermes_block(tools)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
        rest = messages[1:]
    else:
        first, rest = {"role": "system", "content": block}, messages
    return (first, *(as_text(m) for m in rest))


# -- tool calls out ----------------------------------------------------------------------


def template_format(tokenizer) -> str:
    """The tool-call format a chat template teaches (module docstring); `hermes` when it
    says none (a template without tools, read with the Hermes tool block)."""
    template = _template_text(tokenizer)
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and (
        '"parameters"' in template or "<|python_tag|>" in template
    ):
        return "llama3_json"
    return "hermes"


def call_id(fmt: str, turn: int, index: int) -> str:
    """A tool call's id: the same in every rollout of a group (ids never split a state).
    Mistral's templates take 9 alphanumeric characters."""
    return f"call{turn:03d}{index:02d}" if fmt == "mistral" else f"call_{turn}_{index}"


def parse(
    text: str, fmt: str, tools: tuple[dict, ...] | None, turn: int, tokenizer=None, prefix=""
) -> tuple[str | None, list[dict]]:
    """The reply's content and OpenAI tool calls, read in format `fmt` (or by the
    tokenizer's `response_template` where it has one); text that is not a call of a
    declared tool stays in the content."""
    declared = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
    if not declared:
        return text, []
    found = _by_response_template(tokenizer, text, prefix, tools)
    if found is None:
        found = _READERS[fmt](text, declared)
    content, calls = found
    calls = [(name, args) for name, args in calls if name in declared]
    if not calls:
        return text, []
    return (content or None), [
        {
            "id": call_id(fmt, turn, i),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        for i, (name, args) in enumerate(calls)
    ]


def _json(text: str) -> Any:
    try:
        return bounded_json.loads(text)
    except ValueError:
        return None


def _named(obj: Any) -> tuple[str, dict] | None:
    """(name, arguments) of `{"name": …, "arguments"|"parameters": {…}}`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args) if args.strip() else {}
    return (obj["name"], args) if isinstance(args, dict) else None


def _hermes(text: str, declared: dict) -> tuple[str, list]:
    calls, kept, last = [], [], 0
    for match in _HERMES.finditer(text):
        call = _named(_json(match.group(1)))
        if call is None or call[0] not in declared:
            continue
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _qwen3_coder(text: str, declared: dict) -> tuple[str, list]:
    calls, kept, last = [], [], 0
    for match in _CODER.finditer(text):
        name = match.group(1)
        if name not in declared:
            continue
        schema = declared[name].get("properties") or {}
        args = {}
        for key, value in _PARAMETER.findall(match.group(2)):
            kind = (schema.get(key) or {}).get("type")
            parsed = None if kind == "string" else _json(value)
            args[key] = value if parsed is None and kind != "null" else parsed
        calls.append((name, args))
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _llama3_json(text: str, declared: dict) -> tuple[str, list]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    whole = _named(_json(body))
    if whole is not None:
        return "", [whole]
    parts = [_named(_json(p)) for p in body.split(";")] if ";" in body else []
    if parts and all(p is not None for p in parts):
        return "", parts
    return text, []


def _mistral(text: str, declared: dict) -> tuple[str, list]:
    match = _MISTRAL.match(text)
    listed = _json(match.group(1)) if match else None
    calls = [_named(c) for c in listed] if isinstance(listed, list) else []
    if not calls or any(c is None for c in calls):
        return text, []
    return "", calls


_READERS = {
    "hermes": _hermes,
    "qwen3_coder": _qwen3_coder,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
}


def _by_response_template(tokenizer, text: str, prefix: str, tools) -> tuple[str, list] | None:
    """transformers' own reading where the tokenizer carries a `response_template`; None
    where it has none or it fails (the format's reader then reads the reply)."""
    if getattr(tokenizer, "response_template", None) is None:
        return None
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=list(tools))
    except Exception:
        return None
    calls = []
    for call in message.get("tool_calls") or []:
        named = _named(call.get("function", call))
        if named is not None:
            calls.append(named)
    return message.get("content") or "", calls
