"""The one way a seed is derived from others (an actor's seed, a run id, a group counter,
a prompt index), so that runs are reproducible on every machine: a digest of the parts'
text (blake2b), never Python's salted `hash`. Distinct parts give unrelated seeds."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object, bits: int = 31) -> int:
    """A seed of `bits` bits (at most 64) determined by `parts`, joined as text by ':'.
    31 bits fit every engine's seed argument (a signed 32-bit int)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=(bits + 7) // 8)
    return int.from_bytes(digest.digest(), "little") & ((1 << bits) - 1)
