"""How long a reader keeps resolving the store while compactions commit (issue 46).

Every reader loop that resolves the store again when a compaction took a file from under
it (storage/archive.py `step_files`, inspection/sql_sources.py `step_sources`,
inspection/sql.py `query_store`) keeps trying by one rule: at least RESOLVE_ATTEMPTS tries
and RESOLVE_DEADLINE_S seconds, a random pause between two tries that doubles up to
RESOLVE_PAUSE_S, then one line says why it stopped. Counting tries alone let a compactor
that commits back to back exhaust them in a second; time alone would give up at once on a
slow object store. A compaction that defers removal (storage/compaction.py) makes a retry
rare: only a reader whose pass spans two commits needs one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

RESOLVE_ATTEMPTS = 20
RESOLVE_DEADLINE_S = 60.0
RESOLVE_PAUSE_S = 1.0
FIRST_PAUSE_S = 0.01


class Tries:
    """An iterator of try numbers (1, 2, …) by the rule above; after it ends, `count`
    and `seconds` say how many tries it gave and over how long (for the one line)."""

    def __init__(
        self, attempts: int = RESOLVE_ATTEMPTS, deadline_s: float = RESOLVE_DEADLINE_S
    ) -> None:
        self.attempts, self.deadline_s = attempts, deadline_s
        self.count = 0
        self.started = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def exhausted(self) -> bool:
        """Whether the try just made was the last one the rule gives."""
        return self.count >= self.attempts and self.seconds >= self.deadline_s

    def __iter__(self) -> Iterator[int]:
        pause = FIRST_PAUSE_S
        while True:
            self.count += 1
            yield self.count
            if self.exhausted():
                return
            time.sleep(random.uniform(0.0, pause))
            pause = min(2 * pause, RESOLVE_PAUSE_S)

    def spent(self) -> str:
        """`N attempts in S s`, for the line that says why a reader stopped."""
        return f"{self.count} attempts in {self.seconds:.0f} s"
