"""normalized's built-in canonical key as one compiled pass over the keys' UTF-8 bytes.

    canonical_keys_fast(keys) == grouping.canonical_keys(keys), string for string

`canonical_keys` is the rule (Polars regexes: lowercase, digit runs → `#`, whitespace
runs → one space, ends stripped). For ASCII keys it is bytewise: A–Z lowercased; the
first byte of a run of digits becomes `#` and of a run of whitespace (bytes 9–13 and 32,
the ASCII part of Unicode White_Space, which is what the regexes' \\s and strip mean) one
space, the run's other bytes dropped; a leading run of whitespace dropped, and a trailing
space removed. Keys with any non-ASCII byte (where Unicode case, digits and spaces apply)
go through `canonical_keys` itself. numba compiles the kernel on first use (cached on
disk); only the modes that need it import this module.
"""

from __future__ import annotations

import numba
import numpy as np
import polars as pl
import pyarrow as pa

from gagpo.pipeline.grouping import canonical_keys, utf8_buffers

_HASH, _SPACE = 35, 32  # `#` and ` `


@numba.njit(cache=True, nogil=True)
def _canonical_kernel(data, offsets, out, out_offsets, wide):  # pragma: no cover (compiled)
    """out[out_offsets[i]:out_offsets[i + 1]]: key i's canonical bytes (module doc);
    wide[i]: key i holds a non-ASCII byte (its output is then to be replaced)."""
    o = 0
    for i in range(offsets.shape[0] - 1):
        out_offsets[i] = o
        start, run, high = o, 0, False  # run: 0 other, 1 digits, 2 whitespace
        for p in range(offsets[i], offsets[i + 1]):
            c = data[p]
            high |= c >= 128
            if 48 <= c <= 57:
                if run != 1:
                    out[o] = _HASH
                    o += 1
                run = 1
            elif c == 32 or 9 <= c <= 13:
                if run != 2 and o > start:  # a leading run is dropped
                    out[o] = _SPACE
                    o += 1
                run = 2
            else:
                out[o] = c + 32 if 65 <= c <= 90 else c
                o += 1
                run = 0
        if o > start and out[o - 1] == _SPACE:
            o -= 1
        wide[i] = high
    out_offsets[offsets.shape[0] - 1] = o


def canonical_keys_fast(keys: pl.Series) -> pl.Series:
    """`canonical_keys(keys)`, equal string for string (nulls stay null)."""
    n = keys.len()
    if n == 0:
        return keys.cast(pl.String)
    valid = keys.is_not_null().to_numpy()
    data, offsets = utf8_buffers(keys.fill_null(""))
    out = np.empty(int(offsets[-1] - offsets[0]), np.uint8)
    out_offsets, wide = np.empty(n + 1, np.int64), np.empty(n, bool)
    _canonical_kernel(data, np.ascontiguousarray(offsets, np.int64), out, out_offsets, wide)
    null_mask = None if valid.all() else pa.array(valid).buffers()[1]
    arrow = pa.LargeStringArray.from_buffers(
        n, pa.py_buffer(out_offsets), pa.py_buffer(out[: out_offsets[-1]]), null_mask
    )
    result = pl.Series(keys.name, arrow)
    other = np.flatnonzero(wide & valid)
    if other.size:  # Unicode rules
        result = result.scatter(other, canonical_keys(keys.gather(other)))
    return result
