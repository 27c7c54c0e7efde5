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

A history window that drops its oldest turn(s) (a native environment's `history_window`,
or turns dropped to fit the context) keeps the ids of the turns it keeps: the prior
prompt with those turns' ids cut out is extended as above (`_slide`), so a kept reply is
never encoded again either. Where a message begins in a prompt's ids is tracked for that
(`Encoded.starts`); a chat whose starts are not known is rendered afresh.
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
    starts: tuple[int | None, ...] = ()  # per message: where it begins in `prompt` (below)


@dataclass(frozen=True)
class Encoded:
    """A prompt: its ids, the template's text of its messages (None for a stand-in policy
    without a chat template), and whether it extends the prior turn's prompt + action."""

    ids: list[int]
    text: str | None
    extends: bool
    # Per message of the chat: the index in `ids` where it begins, for the messages after
    # the first that are not the assistant's (None where not known): where a window cuts.
    starts: tuple[int | None, ...] = ()


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
        extended = _extend(tokenizer, prior, messages, tools) or _slide(
            tokenizer, prior, messages, tools
        )
        if extended is not None:
            return extended
    text = render(tokenizer, messages, tools, generation=True)
    ids = text_ids(tokenizer, text)
    return Encoded(ids, text, False, _starts(tokenizer, messages, tools, text, ids))


def _starts(tokenizer, messages: Sequence[dict], tools, text: str, ids: list[int]) -> tuple:
    """Where each message after the first that is not the assistant's begins in the ids of
    the template's `text` (None where its rendering up to there is not a prefix of them)."""
    out: list[int | None] = [None]
    for i in range(1, len(messages)):
        if messages[i]["role"] == "assistant":
            out.append(None)
            continue
        head = render(tokenizer, messages[:i], tools, generation=False)
        head_ids = text_ids(tokenizer, head) if text.startswith(head) else None
        fits = head_ids is not None and ids[: len(head_ids)] == head_ids
        out.append(len(head_ids) if fits else None)  # type: ignore[arg-type]
    return tuple(out)


def _slide(tokenizer, prior: Prior, messages: Sequence[dict], tools) -> Encoded | None:
    """The prior prompt with its k oldest turns after the first message cut out (their
    ids, as recorded), then extended by `_extend`; None where `messages` are not the prior
    chat less k such turns, its reply, and what follows, or the cut is not known."""
    old, starts = prior.messages, prior.starts
    if len(starts) != len(old) or len(old) < 2 or starts[1] is None:
        return None
    for cut in range(3, len(old), 2):  # the first message kept after the first one
        kept = (old[0], *old[cut:])
        if tuple(messages[: len(kept)]) != kept or starts[cut] is None:
            continue
        ids = (*prior.prompt[: starts[1]], *prior.prompt[starts[cut] :])
        shift = starts[cut] - starts[1]
        moved = (None, *(None if x is None else x - shift for x in starts[cut:]))
        text = render(tokenizer, kept, tools, generation=True)
        shorter = Prior(kept, prior.tools, text, ids, prior.action, prior.reply, moved)
        return _extend(tokenizer, shorter, messages, tools)
    return None


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
    closed = len(text_ids(tokenizer, end))
    # A reply that ended with the end-of-turn token holds the closing's first token.
    if prior.action and tail[:1] == [prior.action[-1]] and tail[0] in tokenizer.all_special_ids:
        tail, closed = tail[1:], closed - 1
    ids = [*prior.prompt, *prior.action, *tail]
    # One new message (a native turn): it begins after the closing; more: not tracked.
    after = len(prior.prompt) + len(prior.action) + closed
    new = [after] if len(messages) == len(head) + 1 else [None] * (len(messages) - len(head))
    starts = (*(prior.starts or (None,) * len(prior.messages)), None, *new)
    return Encoded(ids, text, True, starts)
