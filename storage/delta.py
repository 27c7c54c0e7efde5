"""Delta publication: a policy version stored as the XOR of its bf16 bits with the
previous version's, compressed with zstd (issue 40; the scheme of SkyRL and slime).

One optimiser step at the learner's rates moves few bf16 weights across a rounding
boundary, and those that move change their low mantissa bits: the XOR of two successive
versions is mostly zero bytes, which zstd shrinks to a fraction of the file
(benchmarks/RESULTS.md, "Delta publication"). A weights file of version N is stored as
`<file>.xor.zst` when version N-1 has a file of that name and size (same tensors, same
header); anything else (a new or resized file, config.json, the tokenizer) is stored as
it is. `delta.json` names the base (N-1) and, per XORed file, its size and CRC-32 so that
applying a delta is checked to reproduce the version bit for bit.

    encode_folder(folder, base)  the learner, before the upload (`DeltaPublisher`)
    apply_folder(folder, base, version)   storage/registry.py `fetch`, into the local cache

The XOR is taken over the whole file, header included: safetensors aligns its data to
8 bytes, so the file's uint16 words are exactly the tensors' bf16 elements, and equal
headers XOR to zeros. Both directions stream in chunks of `CHUNK` bytes, so memory stays
bounded at any model size. Each chunk is byte-split before compression (all high bytes
of the chunk's uint16 words, then all low bytes): sign and exponent bytes, which almost
never change, then become long zero runs (`SPLIT`: 8 % smaller, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError

CHUNK = 1 << 24  # 16 MiB of each file in memory at a time
LEVEL = 3  # zstd's default; level 1 gives the same size (benchmarks/RESULTS.md)
SPLIT = "bytes-split-16"  # delta.json's name for the per-chunk byte split below
WEIGHTS_SUFFIX = ".safetensors"


def _zstd():
    """The zstandard module (the learner and actors extras install it); one line if missing."""
    try:
        import zstandard
    except ImportError:
        raise GagpoError(
            "delta-published policy versions need zstandard: pip install 'gagpo[actors]' "
            "(or 'gagpo[learner]')"
        ) from None
    return zstandard


# --- one chunk ---------------------------------------------------------------------------
def _split(words: np.ndarray) -> bytes:
    """An even-length uint8 chunk as its uint16 words' high bytes, then their low bytes."""
    pairs = words.reshape(-1, 2)  # little-endian: [low, high] per word
    return pairs[:, 1].tobytes() + pairs[:, 0].tobytes()


def _unsplit(data: bytes) -> np.ndarray:
    half = len(data) // 2
    raw = np.frombuffer(data, np.uint8)
    pairs = np.empty((half, 2), np.uint8)
    pairs[:, 1], pairs[:, 0] = raw[:half], raw[half:]
    return pairs.reshape(-1)


def _xor(a: bytes, b: bytes) -> np.ndarray:
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


def _read_exact(stream, size: int) -> bytes:
    """`size` bytes of `stream`, fewer only at its end (zstd readers return short reads)."""
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


# --- one file ----------------------------------------------------------------------------
def encode_file(new: Path, base: Path, out: Path, *, level: int = LEVEL) -> dict:
    """Write `out`, the zstd stream of `new` XOR `base` (equal sizes), chunk by chunk,
    byte-split; return `new`'s record for delta.json (bytes, crc32)."""
    zstd = _zstd()
    crc = 0
    compressor = zstd.ZstdCompressor(level=level, write_checksum=True)
    with (
        open(new, "rb") as a,
        open(base, "rb") as b,
        open(out, "wb") as sink,
        compressor.stream_writer(sink, closefd=False) as writer,
    ):
        while chunk := a.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            words = _xor(chunk, b.read(len(chunk)))
            # an odd tail (never in safetensors, whose data is 8-byte aligned) as is
            even = len(words) - len(words) % 2
            writer.write(_split(words[:even]) + words[even:].tobytes())
    return {"bytes": os.path.getsize(new), "crc32": crc}


def apply_file(delta: Path, base: Path, out: Path, record: dict) -> None:
    """Write `out` = `base` XOR the decompressed `delta`, and check it is the file
    `record` describes (size and CRC-32); a mismatch is a GagpoError naming the file."""
    zstd = _zstd()
    crc, size = 0, 0
    with open(delta, "rb") as d, open(base, "rb") as b, open(out, "wb") as sink:
        reader = zstd.ZstdDecompressor().stream_reader(d)
        while data := _read_exact(reader, CHUNK):
            even = len(data) - len(data) % 2
            words = np.concatenate([_unsplit(data[:even]), np.frombuffer(data[even:], np.uint8)])
            chunk = np.bitwise_xor(words, np.frombuffer(b.read(len(words)), np.uint8)).tobytes()
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            sink.write(chunk)
    if (size, crc) != (record["bytes"], record["crc32"]):
        raise GagpoError(
            f"{delta} applied to {base} gives {size} bytes with CRC-32 {crc}, not the "
            f"version's {record['bytes']} bytes with CRC-32 {record['crc32']}; "
            "its base is not the version it was taken against"
        )


# --- one folder --------------------------------------------------------------------------
def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir() if p.name.endswith(WEIGHTS_SUFFIX))


def encode_folder(folder: Path, base: Path, base_version: int, *, level: int = LEVEL) -> bool:
    """Turn the full version in `folder` into a delta against the full folder `base`
    (version `base_version`): each weights file with a same-sized file in `base` is
    replaced by its `.xor.zst`, and delta.json is written. False (folder untouched) when
    no file qualifies."""
    folder, base = Path(folder), Path(base)
    names = [
        n
        for n in weight_files(folder)
        if (base / n).is_file() and (base / n).stat().st_size == (folder / n).stat().st_size
    ]
    if not names:
        return False
    files = {}
    for name in names:
        files[name] = encode_file(
            folder / name, base / name, folder / f"{name}{layout.DELTA_SUFFIX}"
        )
        (folder / name).unlink()
    record = {"base": base_version, "encoding": SPLIT, "files": files}
    (folder / layout.DELTA).write_text(json.dumps(record, indent=1, sort_keys=True))
    return True


# --- the record: what delta.json may say ----------------------------------------------------
# delta.json is data a store holds: its base and file names become paths and recursion, so
# each is checked before use. A base is a version below the delta's own (a chain of deltas
# only ever descends: no cycle, no delta of itself), a reader replays at most MAX_CHAIN
# deltas (publish_delta_every is at most 100: the learner's chains are shorter), and each
# file is one weights file name of the folder (layout.WEIGHTS_NAME), never a path.
MAX_CHAIN = 100
RECORD_MAX_BYTES = 1 << 20
MAX_FILES = 10_000


def parse_record(data: bytes, where: str, version: int) -> dict:
    """The delta record of version `version` from delta.json's bytes (`where`: the file,
    for the one-line GagpoError that refuses anything but a record this module writes)."""

    def refuse(why: str) -> GagpoError:
        return GagpoError(
            f"{where}: {why}; refused: accepted is a delta record of gagpo's own (a base "
            f"version below v{version}, encoding {SPLIT!r}, files named as plain "
            "*.safetensors names, each with its bytes and CRC-32)"
        )

    if len(data) > RECORD_MAX_BYTES:
        raise refuse(f"{len(data)} bytes, more than {RECORD_MAX_BYTES}")
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        raise refuse("not JSON") from None
    if not isinstance(record, dict):
        raise refuse("not a JSON object")
    base, files = record.get("base"), record.get("files")
    if not layout.is_version(base) or base >= version:
        raise refuse(f"base {str(base)[:40]!r} is not a version below v{version}")
    if record.get("encoding") != SPLIT:
        raise refuse(f"encoding {str(record.get('encoding'))[:40]!r} (a newer gagpo wrote it?)")
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_FILES:
        raise refuse("its files are no object of 1 to 10000 entries")
    for name, described in files.items():
        if not layout.is_weights_name(name):
            raise refuse(f"file name {name[:60]!r} is no plain weights file name")
        if not (isinstance(described, dict) and _is_count(described.get("bytes"))):
            raise refuse(f"{name}: no byte count")
        if not (_is_count(described.get("crc32")) and described["crc32"] < 1 << 32):
            raise refuse(f"{name}: no CRC-32")
    return record


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_record(folder: Path, version: int) -> dict | None:
    """The checked delta record (`parse_record`) of version `version`'s local folder; None
    for a full version. A delta.json that is a symbolic link is refused, never followed."""
    path = Path(folder) / layout.DELTA
    if path.is_symlink():
        raise GagpoError(f"{path} is a symbolic link; refused: a version's files are its own")
    if not path.is_file():
        return None
    with open(path, "rb") as handle:
        data = handle.read(RECORD_MAX_BYTES + 1)
    return parse_record(data, str(path), version)


def apply_folder(folder: Path, base: Path, version: int) -> None:
    """Turn the delta version `version` in `folder` into the full version, in place, using
    the full folder `base` of its base version: each `.xor.zst` becomes its file, and
    delta.json goes. Loaders (transformers, vLLM, the learner's resume) then see a plain
    folder. Every file read is a regular file of `folder` or `base` (no link followed)."""
    folder = Path(folder)
    record = read_record(folder, version)
    for name, described in sorted(record["files"].items()):
        delta, source = folder / f"{name}{layout.DELTA_SUFFIX}", Path(base) / name
        for path in (delta, source):
            if path.is_symlink() or not path.is_file():
                raise GagpoError(
                    f"{path} is no regular file (a link, a folder or missing), and "
                    f"{folder / layout.DELTA} names it; refused: a delta is applied to its "
                    "own files and its base's"
                )
        apply_file(delta, source, folder / name, described)
        delta.unlink()
    (folder / layout.DELTA).unlink()


# --- the learner's side ------------------------------------------------------------------
class DeltaPublisher:
    """Decides, per published version, full or delta, and keeps the previous version's
    full weights files (in a private temporary folder) to take the next delta against.

    A version is full when `every` is 0, when it is a multiple of `every` (the chain an
    actor or a resume replays is never longer than `every` - 1 deltas), a multiple of
    `keep_every` (versions kept for evaluation stand alone), or when the previous version
    is not held here: the first version a learner publishes, after a start or a resume,
    is always full."""

    def __init__(self, every: int, keep_every: int = 0, *, level: int = LEVEL) -> None:
        self.every, self.keep_every, self.level = every, keep_every, level
        self._dir = tempfile.TemporaryDirectory(prefix="gagpo-delta-")
        self._held: int | None = None  # the version whose weights files are in `_dir`

    def is_full(self, version: int) -> bool:
        every, keep_every = self.every, self.keep_every
        return (
            every == 0
            or version % every == 0
            or bool(keep_every and version % keep_every == 0)
            or self._held != version - 1
        )

    def encode(self, folder: Path, version: int) -> bool:
        """Make the full version `version` in `folder` a delta when due (True if it now is
        one); either way its full weights files are held for the next version."""
        folder, held = Path(folder), Path(self._dir.name)
        base, upcoming = held / "base", held / "next"
        shutil.rmtree(upcoming, ignore_errors=True)
        upcoming.mkdir()
        for name in weight_files(folder):  # encoding unlinks them from `folder`: linked here
            _link_or_copy(folder / name, upcoming / name)
        due, self._held = not self.is_full(version), None  # None until `base` is whole again
        encoded = due and encode_folder(folder, base, version - 1, level=self.level)
        shutil.rmtree(base, ignore_errors=True)
        os.replace(upcoming, base)
        self._held = version
        return encoded

    def close(self) -> None:
        self._dir.cleanup()


def _link_or_copy(source: Path, dest: Path) -> None:
    """A hard link (free: the file is never modified, only unlinked), else a copy (another
    file system)."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
