"""Tool-call parsers on each family's real chat template (issue 47; envs/tool_calls.py).

For Qwen2.5 (Hermes form), Qwen3-Coder (XML), Llama 3.1 (JSON) and Mistral ([TOOL_CALLS]),
kept as test data under tests/data/chat_templates/: the format is detected from the
template, the template renders the tools it is given, and the assistant turn the template
writes for a tool call (what the family's models are trained to emit) is read back into the
same OpenAI `tool_calls`. A call that does not parse, or names no declared tool, stays text;
the Hermes block on a template without tools is what the Hermes parser reads back.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gagpo.actors.policies.presets import load_policy
from gagpo.envs import tool_calls
from gagpo.envs.openai_chat import read_request

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = {  # template file -> (format, what ends the assistant turn)
    "qwen2.5-instruct.jinja": ("hermes", "<|im_end|>"),
    "qwen3-coder.jinja": ("qwen3_coder", "<|im_end|>"),
    "llama-3.1-instruct-json.jinja": ("llama3_json", "<|eot_id|>"),
    "mistral-7b-instruct-v0.3.jinja": ("mistral", None),  # its tokenizer's eos_token
}
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for some days.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city."},
                    "days": {"type": "integer", "description": "How many days."},
                },
                "required": ["city", "days"],
            },
        },
    },
)
ARGUMENTS = {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def tokenizer():
    """A real tokenizer (tiny's) whose chat template each test swaps for a family's."""
    return load_policy("tiny", device="cpu").tokenizer


def with_template(tokenizer, name: str):
    """A copy of `tokenizer` with the family's chat template."""
    family = copy.deepcopy(tokenizer)
    family.chat_template = (TEMPLATES / name).read_text(encoding="utf-8")
    return family


def written_call(tokenizer, end: str | None) -> str:
    """The assistant turn the template writes for a call of get_weather(**ARGUMENTS)."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "abcdefghi",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGUMENTS},
            }
        ],
    }
    prompt = tokenizer.apply_chat_template(
        user, tools=list(TOOLS), tokenize=False, add_generation_prompt=True
    )
    whole = tokenizer.apply_chat_template([*user, call], tools=list(TOOLS), tokenize=False)
    # Mistral's template writes no generation prompt: its turn begins after [/INST].
    assert whole.startswith(prompt)
    reply = whole[len(prompt) :]
    end = end or tokenizer.eos_token
    assert reply.rstrip().endswith(end), reply
    return reply.rstrip().removesuffix(end)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_parser_reads_its_familys_template(tokenizer, name):
    fmt, end = FAMILIES[name]
    tok = with_template(tokenizer, name)
    assert tool_calls.template_format(tok) == fmt
    assert tool_calls.renders_tools(tok)
    reply = written_call(tok, end)
    content, calls = tool_calls.parse(reply, fmt, TOOLS, turn=2)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", ARGUMENTS)
    ], reply
    assert calls[0]["id"] == tool_calls.call_id(fmt, 2, 0) and not content
    # Through the request's own reading: the format chosen from the template.
    call = read_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": list(TOOLS)},
        model="m",
        turn=2,
    )
    assert call.reply_format(tok) == fmt
    assert call.reply_format(tok) == read_request(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}, model="m", turn=0
    ).reply_format(tok)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_broken_or_unknown_call_stays_text(tokenizer, name):
    fmt, end = FAMILIES[name]
    reply = written_call(with_template(tokenizer, name), end)
    cut = reply[: len(reply) - 4]  # the call's text cut short: its JSON or tags unclosed
    assert tool_calls.parse(cut, fmt, TOOLS, 0) == (cut, []), cut
    other = reply.replace("get_weather", "launch_rockets")
    assert tool_calls.parse(other, fmt, TOOLS, 0) == (other, [])
    assert tool_calls.parse(reply, fmt, None, 0) == (reply, [])  # no tools declared


def test_text_before_a_call_is_kept_as_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
    content, calls = tool_calls.parse(text, "hermes", TOOLS, 0)
    assert (
        content == "Let me look."
        and json.loads(calls[0]["function"]["arguments"])["city"] == "Oslo"
    )
    coder = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    content, calls = tool_calls.parse(coder, "qwen3_coder", TOOLS, 0)
    assert content == "Checking." and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "New York",
        "days": 2,
    }
    # Mistral's marker is a special token: a reply decoded without it still parses.
    bare = ' [{"name": "get_weather", "arguments": {"city": "Rome", "days": 5}}]'
    assert tool_calls.parse(bare, "mistral", TOOLS, 0)[1][0]["id"] == "call00000"


def test_a_call_nested_past_the_depth_bound_stays_text():
    deep = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": '
        + "[" * 900
        + "]" * 900
        + "}}</tool_call>"
    )
    assert tool_calls.parse(deep, "hermes", TOOLS, 0) == (deep, [])


def test_the_hermes_block_on_a_template_without_tools_is_read_back(tokenizer):
    """tiny's template renders no tools: a call with tools is refused unless its tools go
    in as the Hermes block, whose replies are then read in the Hermes form, and whose
    earlier tool calls are written back as the text the model wrote."""
    assert not tool_calls.renders_tools(load_policy("tiny", device="cpu").tokenizer)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": list(TOOLS)}
    plain = load_policy("tiny", device="cpu").tokenizer
    refused = read_request(body, model="m", turn=0)
    with pytest.raises(ValueError, match="renders no tools"):
        refused.chat_for(plain)
    call = read_request(body, model="m", turn=0, tool_prompt="hermes")
    messages, tools = call.chat_for(plain)
    assert tools is None and messages[0]["role"] == "system"
    assert "<tools>" in messages[0]["content"] and "get_weather" in messages[0]["content"]
    assert call.reply_format(plain) == "hermes"
    said = tool_calls.as_text(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "x", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
            ],
        }
    )
    assert (
        tool_calls.parse(said["content"], "hermes", TOOLS, 0)[1][0]["function"]["name"]
        == "get_weather"
    )
