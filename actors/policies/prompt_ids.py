"""A turn's prompt ids: the previous turn's ids and the reply's sampled ids, extended.

Tokens in = tokens out (issue 38). When the next prompt holds the conversation of the
previous one and the reply the policy gave, unchanged, its ids are

    previous prompt_ids + action_ids + the template's closing of the reply's turn
    + the template's rendering of the messages after it (and the generation prompt),

so the ids the policy sampled are never decoded and encoded again: decoding loses special
tokens, and encoding merges and splits whitespace differently, so a round trip would
change the context of every later step. Where the round trip is lossless this is exactly
the template's own tokenization of the whole conversation. Where the conversation was
edited, turns dropped, tools changed, or the template renders earlier turns differently
once a later one follows (a reasoning template stripping old thoughts), the template
renders the messages afresh: the step starts a new segment (its prompt does not extend).

The closing of an assistant turn is what the template writes after its content
(`<|im_end|>\n` for ChatML). A reply that ended with the end-of-turn token already holds
its first token; a reply cut by max_tokens or a stop sequence gets all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Content no template alters: where it appears, the assistant's content ended.
_MARK = "gagpo-end-of-content-7c1e"


@dataclass(frozen=True)
class Prior:
    """A recorded turn the next prompt may extend."""

    messages: tuple[dict, ...]  # the chat of its prompt
    tools: tuple[dict, ...] | None
    text: str  # the template's rendering of `messages` with the generation prompt
    prompt: tuple[int, ...]  # its prompt_ids
    action: tuple[int, ...]  # its action_ids (the reply as sampled, cut as answered)
    reply: dict  # the assistant message the conversation holds for it


@dataclass(frozen=True)
class Encoded:
    """A prompt: its ids, the template's text of its messages (None for a stand-in policy
    without a chat template), and whether it extends the prior turn's prompt + action."""

    ids: list[int]
    text: str | None
    extends: bool


def render(tokenizer, messages: Sequence[dict], tools, *, generation: bool) -> str:
    """The chat template's text of `messages` (and `tools`)."""
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=generation, tokenize=False, **extra
    )


def text_ids(tokenizer, text: str) -> list[int]:
    """`text` as ids; the template's own special tokens are in the text."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(
    policy, messages: Sequence[dict], tools=None, prior: Prior | None = None
) -> Encoded:
    """The prompt ids of `messages`: the prior turn extended where the conversation holds
    it unchanged (module docstring), else the template's rendering. Never cut: the caller
    answers a prompt past the context (actors/rollout.py)."""
    tokenizer = getattr(policy, "tokenizer", None)
    if not hasattr(tokenizer, "apply_chat_template"):  # a stand-in policy: its own ids
        return Encoded(list(policy.encode_chat(list(messages))), None, False)
    if prior is not None:
        extended = _extend(tokenizer, prior, messages, tools)
        if extended is not None:
            return extended
    text = render(tokenizer, messages, tools, generation=True)
    return Encoded(text_ids(tokenizer, text), text, False)


def closing(tokenizer) -> str:
    """What the template writes after an assistant message's content."""
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
    text = render(tokenizer, chat, None, generation=False)
    return text[text.rindex(_MARK) + len(_MARK) :]


def _extend(tokenizer, prior: Prior, messages: Sequence[dict], tools) -> Encoded | None:
    """The prior turn's ids extended by what follows its reply; None where the messages do
    not begin with the prior chat and its reply unchanged, or the template does not
    render them as the prior prompt continued."""
    head = (*prior.messages, prior.reply)
    if (tools or None) != (prior.tools or None) or tuple(messages[: len(head)]) != head:
        return None
    answered = render(tokenizer, head, tools, generation=False)
    text = render(tokenizer, messages, tools, generation=True)
    end = closing(tokenizer)
    if not (
        answered.startswith(prior.text) and answered.endswith(end) and text.startswith(answered)
    ):
        return None
    tail = text_ids(tokenizer, end + text[len(answered) :])
    # A reply that ended with the end-of-turn token holds the closing's first token.
    if prior.action and tail[:1] == [prior.action[-1]] and tail[0] in tokenizer.all_special_ids:
        tail = tail[1:]
    return Encoded([*prior.prompt, *prior.action, *tail], text, True)
