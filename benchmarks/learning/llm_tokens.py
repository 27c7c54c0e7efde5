"""Tokens a learner update encodes for a run's groups: one row per step (what the learner
encodes when prompts carry no history, `history_window = 0`) against a prefix tree of each
group's sequences, where every distinct prefix (the shared system prompt, a group's
identical first prompt) is encoded once (issue 45).

    python benchmarks/learning/llm_tokens.py STORE
"""

from __future__ import annotations

import sys

import polars as pl

from gagpo.storage.archive import read_steps_table
from gagpo.storage.store import Store


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/learning/llm_tokens.py STORE")
    steps = read_steps_table(Store(sys.argv[1]), ["group_id", "prompt_ids", "action_ids"])
    table = pl.from_arrow(steps)
    rows = tree = 0
    for _, group in table.group_by("group_id"):
        prefixes = set()
        for prompt, action in zip(group["prompt_ids"], group["action_ids"], strict=True):
            sequence = (*prompt, *action)
            rows += len(sequence)
            prefixes.update(sequence[:i] for i in range(1, len(sequence) + 1))
        tree += len(prefixes)
    print(
        f"groups {table['group_id'].n_unique()}  steps {table.height}  tokens as rows {rows}  "
        f"in a prefix tree {tree}  ratio {tree / max(rows, 1):.2f}"
    )


if __name__ == "__main__":
    main()
