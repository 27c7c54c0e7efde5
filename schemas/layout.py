"""The store's layout: every folder and file a GAGPO store holds is named here, and only here.

Each function takes the store's root, a path (`Store.root`) or a URL (`Store.url`), and
returns where one artefact lives under it; where code reads ids back out of a path, the
artefact has a parser beside its builder. Numbered names (versions, generations, updates)
take an int, or a string such as "*" for a glob pattern or "<N>" for the docs. Nothing here
touches a file system: `Store` (storage/store.py) lists, reads, commits and retries.

docs/store.md ("Layout") is the one full listing; `LAYOUT` below is what it shows, and
tests/test_layout_owner.py checks both that the listing matches and that no other module
builds a store path from a folder or file name of its own.
"""

from __future__ import annotations

import numbers
import posixpath
import re

from gagpo.schemas.errors import GagpoError

PARQUET = ".parquet"
JSON = ".json"

# --- folders and files: the names --------------------------------------------------------
SHARDS = "shards"
RUN_PREFIX = "run="  # shards/run=<run_id>/
ARCHIVE = "archive"
MANIFESTS = "manifest"
MOVED_SUFFIX = ".moved.json"  # archive/manifest/<generation>-<id>.moved.json
CLEARED_SUFFIX = ".cleared"  # archive/manifest/<generation>.cleared
SEGMENTS = "segments"
LEDGER_PARTS = "ledger"  # archive/ledger/
ADVANTAGES = "advantages"
POLICY = "policy"
LATEST = "LATEST"
COMPLETE = ".complete"  # marker committed last into a folder written file by file
LINEAGE = "lineage.json"  # policy/v<N>/: version, parent, update, ids (learner/checkpoint.py)
DELTA = "delta.json"  # policy/v<N>/ of a delta version: its base version, the files it changes
DELTA_SUFFIX = ".xor.zst"  # policy/v<N>/<weights file>.xor.zst: XOR with the base's, zstd
LOADS = "loads"  # policy/loads/<run_id>-<load_id>.parquet: an actor's version loads
LEARNER = "learner"
LEDGER = "ledger.parquet"  # learner/ledger.parquet, and a training state's copy of it
CHECKPOINTS = "checkpoints"
STATE_RECORD = "state.json"  # the files of a training state, learner/checkpoints/v<N>/
STATE_TRAINER = "trainer.pt"  # optimiser, scheduler, RNG states
STATE_TRAINABLE = "trainable.safetensors"  # the trained adapter weights (LoRA runs only)
STATE_LEDGER = LEDGER  # the ledger's tail as it stood after that update
METRICS = "metrics"
HISTOGRAMS = "histograms.zarr"
LEASE = "lease"
TENSORBOARD = "tensorboard"
EVAL = "eval"
HELDOUT = "heldout.parquet"
RAY = "ray"
RESTARTS_PREFIX = "restarts-"  # ray/restarts-<run id>.parquet
REPORT = "report"
QUARANTINE = "quarantine"
REASON_SUFFIX = ".reason.json"

# Every name above that is a folder or file of a store (tests/test_layout_owner.py: no
# other module builds a path from one of these as a literal).
NAMES = frozenset(
    {
        SHARDS,
        ARCHIVE,
        MANIFESTS,
        SEGMENTS,
        LEDGER_PARTS,
        ADVANTAGES,
        POLICY,
        LATEST,
        COMPLETE,
        LINEAGE,
        DELTA,
        LOADS,
        LEARNER,
        LEDGER,
        CHECKPOINTS,
        STATE_RECORD,
        STATE_TRAINER,
        STATE_TRAINABLE,
        METRICS,
        HISTOGRAMS,
        LEASE,
        TENSORBOARD,
        EVAL,
        HELDOUT,
        RAY,
        REPORT,
        QUARANTINE,
    }
)


def join(root: str, *parts: str) -> str:
    return posixpath.join(root, *parts)


# --- ids: what a name built from data may hold ---------------------------------------------
# Segment, ledger-part, shard and run ids, advantage tables and moved lists are named by ids
# that manifests, moved lists, ledgers and shards carry: data a store's writer, or whoever
# sent the store, chose. Each becomes one file name, so an id is one plain name: a letter or
# digit first (never `.` or `..`), then letters, digits, `_`, `.`, `-` and `=`; no `/`, no
# glob or URL character; short enough for any file system once `.parquet` and a temporary
# prefix are added (NAME_MAX is 255).
ID_MAX = 200
ID_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9_.=-]{{0,{ID_MAX - 1}}}"
_ID = re.compile(ID_PATTERN)
# A glob of all of them, or a name for the docs ("<segment_id>", "<generation>-<id>.moved.json")
_PLACEHOLDER = re.compile(r"\*|<[A-Za-z0-9_.=<> -]*")


def new_id() -> str:
    """A globally unique, time-sortable id (ULID, lower case: it matches ID_PATTERN): no
    coordination between writers."""
    from ulid import ULID

    return str(ULID()).lower()


def is_id(value: object) -> bool:
    """Whether `value` is an id a store file may be named by (`ID_PATTERN`)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def id_problem(value: object) -> str | None:
    """Why `value` is no id (a short phrase, the value cut to 60 characters); None if it is."""
    if is_id(value):
        return None
    shown = (
        repr(value[:60]) + ("…" if len(value) > 60 else "")
        if isinstance(value, str)
        else repr(value)
    )
    return f"{shown} is not a file id (accepted: {ID_PATTERN}, at most {ID_MAX} characters)"


def _named(value: str, what: str) -> str:
    """`value` as the id part of a file name: an id, or a pattern/placeholder; anything
    else (`../x`, `/etc/passwd`, `a[b]`, a 1 MB string) is refused before it is joined."""
    if isinstance(value, str) and (is_id(value) or _PLACEHOLDER.fullmatch(value)):
        return value
    raise GagpoError(f"{what}: {id_problem(value)}; refused: a store names only its own files")


def _numbered(value: int | str, digits: int) -> str:
    """A zero-padded number (names sort as numbers), or a pattern/placeholder as given."""
    return f"{value:0{digits}d}" if isinstance(value, int) else value


def _number(path: str, suffix: str) -> int | None:
    """The number a `_numbered` file name carries; None for any other name."""
    name = posixpath.basename(path)
    stem = name[: -len(suffix)] if name.endswith(suffix) else ""
    return int(stem) if stem.isdigit() else None


# --- versions: what policy/LATEST and a version folder's name may hold ---------------------
# A policy version (and the training state named by it) is a number below MAX_VERSION,
# written without leading zeros: `v7`, never `v07` (which would name a second folder of
# version 7) nor `v-5`. LATEST holds one such number and a newline: a reader never builds
# or lists more than MAX_VERSION of anything from it (`gagpo sql`'s policy_versions has a
# row per version up to LATEST), and reads at most LATEST_MAX_BYTES of it.
MAX_VERSION = 10**7
_VERSION_TEXT = r"(0|[1-9][0-9]{0,6})"
_VERSION_DIR = re.compile(rf"^v{_VERSION_TEXT}$")
_LATEST_TEXT = re.compile(rf"{_VERSION_TEXT}\n?")
LATEST_MAX_BYTES = 16


def _version(path: str) -> int | None:
    match = _VERSION_DIR.match(posixpath.basename(path.rstrip("/")))
    return int(match.group(1)) if match else None


def is_version(value: object) -> bool:
    """Whether `value` is a policy version a store may name (an int in [0, MAX_VERSION))."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return integral and 0 <= value < MAX_VERSION


def parse_latest(data: bytes) -> int | None:
    """The version LATEST's bytes name (`7` or `7\\n`); None for anything else."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    match = _LATEST_TEXT.fullmatch(text)
    return int(match.group(1)) if match else None


def latest_text(version: int) -> bytes:
    """What LATEST holds when it names `version`; a version out of range is refused."""
    if not is_version(version):
        raise GagpoError(
            f"policy version {version!r} cannot be published: accepted versions are 0 to "
            f"{MAX_VERSION - 1} (policy/LATEST names one of them)"
        )
    return f"{version}\n".encode()


# A file a delta version XORs with its base's (delta.json's `files`): one plain weights file
# name of the version's own folder, as transformers names them (model.safetensors,
# model-00001-of-00002.safetensors, adapter_model.safetensors); never a path.
WEIGHTS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}\.safetensors")


def is_weights_name(value: object) -> bool:
    return (
        isinstance(value, str) and WEIGHTS_NAME.fullmatch(value) is not None and ".." not in value
    )


def data_folders(root: str) -> tuple[str, ...]:
    """The folders one of which a store that holds data has: actors' or a learner's."""
    return join(root, SHARDS), join(root, POLICY), join(root, LEARNER)


# --- the inbox ---------------------------------------------------------------------------
def shards_dir(root: str) -> str:
    return join(root, SHARDS)


def run_dir(root: str, run_id: str) -> str:
    return join(root, SHARDS, f"{RUN_PREFIX}{_named(run_id, 'run id')}")


def shard(root: str, run_id: str, shard_id: str) -> str:
    """A committed shard; `shard(root, "*", "*")` is the pattern of all of them."""
    return join(run_dir(root, run_id), f"{_named(shard_id, 'shard id')}{PARQUET}")


def parse_shard(path: str) -> tuple[str, str] | None:
    """(run_id, shard_id) of a shard's path; None for a temporary file or anything else,
    a name whose ids are no ids (`is_id`) included: no writer of ours names a file so, and
    every path built from a shard's ids must stay one plain name."""
    name = posixpath.basename(path)
    folder = posixpath.basename(posixpath.dirname(path))
    if name.startswith(".") or not name.endswith(PARQUET) or not folder.startswith(RUN_PREFIX):
        return None
    run_id, shard_id = folder[len(RUN_PREFIX) :], name[: -len(PARQUET)]
    return (run_id, shard_id) if is_id(run_id) and is_id(shard_id) else None


# --- the archive -------------------------------------------------------------------------
def manifests_dir(root: str) -> str:
    return join(root, ARCHIVE, MANIFESTS)


def manifest(root: str, generation: int | str) -> str:
    return join(manifests_dir(root), f"{_numbered(generation, 10)}{JSON}")


def parse_manifest(path: str) -> int | None:
    """The generation of a manifest's path; None for any other file."""
    return _number(path, JSON)


def moved_name(generation: int | str, unique: str) -> str:
    """The name of a generation's moved-shards sidecar (its manifest records the name)."""
    return f"{_numbered(generation, 10)}-{unique}{MOVED_SUFFIX}"


def moved(root: str, name: str) -> str:
    """The moved-shards sidecar `name` (`moved_name`)."""
    return join(manifests_dir(root), _named(name, "moved list"))


def is_moved_name(name: object) -> bool:
    """Whether `name` is a moved-shards sidecar's file name (`moved_name`), and nothing else."""
    return is_id(name) and (parse_manifest_folder(name) or ("", 0))[0] == "moved"


def cleared(root: str, generation: int | str) -> str:
    """The marker that a generation's moved shards are gone from the inbox."""
    return join(manifests_dir(root), f"{_numbered(generation, 10)}{CLEARED_SUFFIX}")


def parse_manifest_folder(path: str) -> tuple[str, int] | None:
    """What a file of archive/manifest/ is, and of which generation: ("manifest", g),
    ("moved", g) or ("cleared", g); None for anything else (a temporary file)."""
    name = posixpath.basename(path)
    head = name.split(".", 1)[0]
    if name.endswith(MOVED_SUFFIX) and head.split("-", 1)[0].isdigit():
        return "moved", int(head.split("-", 1)[0])
    if name.endswith(CLEARED_SUFFIX) and head.isdigit():
        return "cleared", int(head)
    if name == f"{head}{JSON}" and head.isdigit():
        return "manifest", int(head)
    return None


def segments_dir(root: str) -> str:
    return join(root, ARCHIVE, SEGMENTS)


def segment(root: str, segment_id: str) -> str:
    return join(segments_dir(root), f"{_named(segment_id, 'segment id')}{PARQUET}")


def ledger_parts_dir(root: str) -> str:
    return join(root, ARCHIVE, LEDGER_PARTS)


def ledger_part(root: str, segment_id: str) -> str:
    return join(ledger_parts_dir(root), f"{_named(segment_id, 'ledger part id')}{PARQUET}")


def file_id(path: str) -> str | None:
    """The id a segment, ledger part or advantage table is named by (its name without
    `.parquet`); None for a temporary (dot) file or anything else."""
    name = posixpath.basename(path)
    return None if name.startswith(".") or not name.endswith(PARQUET) else name[: -len(PARQUET)]


# --- advantages --------------------------------------------------------------------------
def advantages_dir(root: str, tag: str | None = None) -> str:
    """advantages/, or the folder of one estimator tag."""
    return join(root, ADVANTAGES) if tag is None else join(root, ADVANTAGES, tag)


def advantages(root: str, tag: str, file_id: str) -> str:
    """The advantage table of one shard or segment (named by its id) under `tag`."""
    return join(root, ADVANTAGES, tag, f"{_named(file_id, 'advantage table id')}{PARQUET}")


# --- policy versions ---------------------------------------------------------------------
def policy_root(root: str) -> str:
    return join(root, POLICY)


def _version_dir(version: int | str, what: str) -> str:
    """`v<version>` for a version (`is_version`), or a pattern/placeholder as given."""
    if is_version(version) or (isinstance(version, str) and _PLACEHOLDER.fullmatch(version)):
        return f"v{version}"
    raise GagpoError(
        f"{what}: {version!r} is no policy version (accepted: 0 to {MAX_VERSION - 1}); "
        "refused: a store names only its own files"
    )


def policy_dir(root: str, version: int | str) -> str:
    return join(root, POLICY, _version_dir(version, "policy version"))


def parse_policy_dir(path: str) -> int | None:
    """The version of a policy folder's path (`v7` → 7); None for anything else."""
    return _version(path)


def latest(root: str) -> str:
    return join(root, POLICY, LATEST)


def complete(folder: str) -> str:
    """The `.complete` marker of a folder written file by file (a policy version, a state)."""
    return join(folder, COMPLETE)


def lineage(root: str, version: int | str) -> str:
    return join(policy_dir(root, version), LINEAGE)


def delta(folder: str) -> str:
    """The delta record of a policy version's folder (only delta versions have one)."""
    return join(folder, DELTA)


def loads_dir(root: str) -> str:
    return join(root, POLICY, LOADS)


def loads(root: str, run_id: str, load_id: str) -> str:
    """One actor's record of the versions it loaded (storage/registry.py `record_loads`);
    `loads(root, "*", "*")` is the pattern of all of them. Each actor writes under its own
    run id, so no two writers ever name the same file."""
    name = f"{_named(run_id, 'run id')}-{_named(load_id, 'load record id')}"
    return join(loads_dir(root), f"{name}{PARQUET}")


def parse_loads(path: str) -> tuple[str, str] | None:
    """(run_id, load_id) of a loads file's path (`loads`); None for a temporary file or
    any other name (its ids are no ids, or it has no `-` between them)."""
    name = posixpath.basename(path)
    stem = name[: -len(PARQUET)] if name.endswith(PARQUET) else ""
    run_id, _, load_id = stem.rpartition("-")
    return (run_id, load_id) if is_id(run_id) and is_id(load_id) else None


# --- the learner -------------------------------------------------------------------------
def learner_dir(root: str) -> str:
    return join(root, LEARNER)


def ledger(root: str) -> str:
    """The ledger's tail: groups consumed and still in the inbox (archived rows: ledger_part)."""
    return join(root, LEARNER, LEDGER)


def checkpoints_dir(root: str) -> str:
    return join(root, LEARNER, CHECKPOINTS)


def checkpoint_dir(root: str, version: int | str) -> str:
    """The training state of published version `version`."""
    return join(checkpoints_dir(root), _version_dir(version, "training state"))


def parse_checkpoint_dir(path: str) -> int | None:
    return _version(path)


def metrics_dir(root: str) -> str:
    return join(root, LEARNER, METRICS)


def metrics(root: str, update: int | str) -> str:
    return join(metrics_dir(root), f"{_numbered(update, 8)}{PARQUET}")


def parse_metrics(path: str) -> int | None:
    """The update of a metrics file's path; None for a temporary file or anything else."""
    return _number(path, PARQUET)


def histograms(root: str) -> str:
    return join(root, LEARNER, HISTOGRAMS)


def lease_dir(root: str) -> str:
    return join(root, LEARNER, LEASE)


def lease(root: str, generation: int | str) -> str:
    return join(lease_dir(root), f"{_numbered(generation, 8)}{JSON}")


def parse_lease(path: str) -> int | None:
    return _number(path, JSON)


def tensorboard_dir(root: str) -> str:
    return join(root, LEARNER, TENSORBOARD)


# --- evaluation, launches, reports, quarantine -------------------------------------------
def heldout(root: str) -> str:
    return join(root, EVAL, HELDOUT)


def restarts(root: str, run_id: str) -> str:
    return join(root, RAY, f"{RESTARTS_PREFIX}{run_id}{PARQUET}")


def report_dir(root: str) -> str:
    return join(root, REPORT)


def quarantine_dir(root: str) -> str:
    return join(root, QUARANTINE)


def quarantined(root: str, path: str) -> str:
    """Where the store's file `path` goes in quarantine: its path under the root, flattened."""
    relative = posixpath.relpath(path, root).replace("/", "__")
    return join(root, QUARANTINE, relative)


def reason(quarantined_path: str) -> str:
    """The reason record beside a quarantined file."""
    return f"{quarantined_path}{REASON_SUFFIX}"


def reasons(root: str) -> str:
    """The pattern of every reason record in quarantine."""
    return reason(join(quarantine_dir(root), "*"))


# --- the listing docs/store.md shows -------------------------------------------------------
_S = "STORE"
LAYOUT: tuple[tuple[str, str], ...] = (
    (shard(_S, "<run_id>", "<shard_id>"), "the inbox: committed trajectory shards"),
    (manifest(_S, "<generation>"), "the archive: which segments hold which groups"),
    (moved(_S, moved_name("<generation>", "<id>")), "the shards that generation moved"),
    (cleared(_S, "<generation>"), "marker: those shards are gone from the inbox"),
    (segment(_S, "<segment_id>"), "consumed groups, compacted (by group, large files)"),
    (ledger_part(_S, "<segment_id>"), "the ledger rows of those groups"),
    (advantages(_S, "<estimator_tag>", "<id>"), "advantage tables, per shard or segment"),
    (policy_dir(_S, "<N>") + "/", "published policy (HF folder or PEFT adapter)"),
    (complete(policy_dir(_S, "<N>")), "marker: the folder is complete"),
    (lineage(_S, "<N>"), "version, parent, update, ids"),
    (delta(policy_dir(_S, "<N>")), "a delta version: its base, the files it XORs"),
    (
        policy_dir(_S, "<N>") + "/<file>" + DELTA_SUFFIX,
        "… each weights file's XOR with the base's, zstd",
    ),
    (loads(_S, "<run_id>", "<id>"), "versions an actor loaded: fetch and pause seconds"),
    (latest(_S), "the newest complete version, as text"),
    (ledger(_S), "the ledger's tail: groups consumed, still in the inbox"),
    (checkpoint_dir(_S, "<N>") + "/", f"training state: {STATE_RECORD}, {STATE_TRAINER}, {LEDGER}"),
    (metrics(_S, "<update>"), "one row of learner metrics per update"),
    (histograms(_S) + "/", "dense per-update histograms"),
    (lease(_S, "<generation>"), "the one learner's lease (docs/store.md)"),
    (tensorboard_dir(_S) + "/", "TensorBoard logs (learner.log_to, local stores)"),
    (heldout(_S), "held-out success per evaluated version (gagpo run)"),
    (restarts(_S, "<run id>"), "restarts of one gagpo run --ray"),
    (report_dir(_S) + "/", "gagpo run's report: summary.md and figures"),
    (quarantined(_S, join(_S, "<path>")), "a file that failed validation"),
    (reason(quarantined(_S, join(_S, "<path>"))), "… and why"),
)


def listing() -> str:
    """`LAYOUT` as the text block of docs/store.md."""
    width = max(len(path) for path, _ in LAYOUT) + 2
    return "\n".join(f"{path:<{width}}{what}".rstrip() for path, what in LAYOUT)
