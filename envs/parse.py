"""Turn an agent's reply into a bare command string, or into one of the admissible actions.

Small models wrap their command in many ways ("Action: go to cabinet 1.", "`up`",
"> look"); every environment applies the same normalisation before matching, so a
reply is judged on its command and not on its decoration.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Characters that wrap or end a command but never belong to one.
_DECORATION = " \t\"'`*<>[](){}.,;:!?"
_MARKER = "action:"

# Wrappers small models put around a command: "Action: ", "> ", "- ", "1. ", "**", "`".
_PREFIX = re.compile(
    r"^\s*(?:(?:action|command|answer|next action)\s*:|>|-|\*+|\d+[.)])\s*", re.IGNORECASE
)
_ACTION_MARKER = re.compile(r"\baction\s*:", re.IGNORECASE)
_WRAPPING = " \t\"'`*"
_WORDS = re.compile(r"\w+|[^\w\s]")


def normalise_command(text: str) -> str:
    """Lower-case command found in `text`: after the last "Action:" marker, first
    non-empty line, stripped of quotes, markdown and end punctuation, single-spaced."""
    s = text.lower()
    marker = s.rfind(_MARKER)
    if marker >= 0:
        s = s[marker + len(_MARKER) :]
    line = next((ln for ln in s.splitlines() if ln.strip(_DECORATION)), "")
    return " ".join(line.strip(_DECORATION).split())


def _first_line(reply: str) -> str:
    """First non-empty line, without "Action:"-style prefixes, quotes or end punctuation."""
    line = next((ln for ln in reply.splitlines() if ln.strip(_WRAPPING + ".")), "")
    markers = list(_ACTION_MARKER.finditer(line))
    if markers:  # "I will open it. Action: open drawer 1" → after the last marker
        line = line[markers[-1].end() :]
    previous = None
    while previous != line:
        previous = line
        line = _PREFIX.sub("", line).strip(_WRAPPING)
    return line.rstrip(".!").strip(_WRAPPING)


def _normalise(text: str) -> str:
    """Lower-case words and punctuation, single-spaced and padded: "In/On x" → " in / on x "."""
    return " " + " ".join(_WORDS.findall(text.lower())) + " "


def parse_action(reply: str, admissible: Sequence[str] | None) -> str:
    """The action a reply names.

    With admissible actions: the longest one that occurs in the reply as whole words
    (case, spacing and spaces around punctuation ignored; ties go to the earliest), so
    "Action: go to cabinet 12." picks "go to cabinet 12", never "go to cabinet 1".
    Otherwise, or if none occurs: the reply's first non-empty line, cleaned.
    """
    if admissible:
        text = _normalise(reply)
        found = [
            (len(a), -text.find(_normalise(a)), a)
            for a in admissible
            if a.strip() and _normalise(a) in text
        ]
        if found:
            return max(found)[2]
    return _first_line(reply)
