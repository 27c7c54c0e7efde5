"""Prompts in, actions out: `build_messages` and `parse_action`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagpo.actors.prompts import REPLY_REQUEST, build_messages
from gagpo.envs.parse import parse_action

HISTORY = [(f"obs {i}", f"act {i}") for i in range(5)]


def test_messages_hold_system_window_and_current_turn():
    messages = build_messages("rules", HISTORY, "now", ["go to desk 1", "look"], window=2)
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert messages[0]["content"] == "rules"
    assert [m["content"] for m in messages[1:5]] == ["obs 3", "act 3", "obs 4", "act 4"]
    last = messages[-1]["content"]
    assert last.startswith("now")
    assert "- go to desk 1\n- look" in last
    assert last.endswith(REPLY_REQUEST)


@pytest.mark.parametrize("window", [0, 1, 5, 50])
def test_window_bounds_the_history(window):
    messages = build_messages("rules", HISTORY, "now", None, window=window)
    assert len(messages) == 2 + 2 * min(window, len(HISTORY))


def test_without_admissible_actions_there_is_no_list():
    last = build_messages("rules", [], "grid", None, window=3)[-1]["content"]
    assert last == f"grid\n\n{REPLY_REQUEST}"
    assert "Admissible" not in build_messages("rules", [], "grid", [], window=3)[-1]["content"]


def test_negative_window_is_rejected():
    with pytest.raises(ValueError, match="window"):
        build_messages("rules", HISTORY, "now", None, window=-1)


ADMISSIBLE = [
    "go to cabinet 1",
    "go to cabinet 12",
    "open cabinet 1",
    "put mug 1 in/on cabinet 12",
    "look",
]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("go to cabinet 12", "go to cabinet 12"),
        ("Action: Go to cabinet 12.", "go to cabinet 12"),  # never the shorter prefix "cabinet 1"
        ("> go to cabinet 1", "go to cabinet 1"),
        ("I will open cabinet 1 and then look", "open cabinet 1"),  # longest that occurs
        ("look, then go to cabinet 1", "go to cabinet 1"),
        ("put mug 1 in / on cabinet 12", "put mug 1 in/on cabinet 12"),  # word-level spacing
        ("PUT MUG 1 IN/ON CABINET 12!", "put mug 1 in/on cabinet 12"),
        ("\n\n  look\nsomething else", "look"),
        ("lookout", "lookout"),  # whole words only: no admissible action occurs
    ],
)
def test_parse_action_with_admissible(reply, expected):
    assert parse_action(reply, ADMISSIBLE) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("up", "up"),
        ("  Action: left.\nbecause", "left"),
        ("> down", "down"),
        ("- right", "right"),
        ("1. up", "up"),
        ("`up`", "up"),
        ("**Action:** up", "up"),
        ("I think so. Action: down", "down"),
        ("\n\n", ""),
        ("", ""),
    ],
)
def test_parse_action_without_admissible(reply, expected):
    assert parse_action(reply, None) == expected


def test_ties_go_to_the_earliest_occurrence():
    assert parse_action("go west or go east", ["go east", "go west"]) == "go west"


@given(
    st.sampled_from(ADMISSIBLE),
    st.sampled_from(["", "Action: ", "> ", "I choose: "]),
    st.booleans(),
)
def test_an_admissible_reply_parses_to_itself(action, prefix, shout):
    # No action above is a whole-word part of a longer one ("cabinet 1" is not "cabinet 12").
    reply = f"{prefix}{action.upper()}." if shout else f"{prefix}{action}"
    assert parse_action(reply, ADMISSIBLE) == action
