"""Environments shaped for a test."""

from __future__ import annotations

from gagpo.envs.sokoban import Sokoban


class Staggered(Sokoban):
    """Even task seeds end after 2 turns, odd ones after 6: groups in flight end apart."""

    def reset(self, task_seed: int):
        self.max_turns = 2 if task_seed % 2 == 0 else 6
        return super().reset(task_seed)
