"""Validation of stored steps against the column contract (docs/design.md §3).

Each check raises `ValidationError` with the reason; the store moves a file that
fails to `quarantine/` with that reason beside it. A hostile file (wrong metadata types,
no rows, token ids outside the vocabulary, a group already held by another shard) gets
a reason too, never a crash: `validate_steps` turns any error a check did not foresee
into a ValidationError as well.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from gagpo.schemas import columns as C
from gagpo.schemas.errors import ValidationError, describe


def check_schema_version(metadata: dict[bytes, bytes] | None) -> str:
    """Return the file's schema version; reject missing or unknown major versions."""
    raw = (metadata or {}).get(C.META_SCHEMA_VERSION)
    if raw is None:
        raise ValidationError(
            f"no schema version in file metadata (key {C.META_SCHEMA_VERSION.decode()}); "
            f"accepted: {C.STEPS_SCHEMA_VERSION}"
        )
    version = raw.decode(errors="replace")
    try:
        major = C.schema_major(version)
        C.steps_columns(version)  # the minor part parses too
    except ValueError:
        raise ValidationError(
            f"malformed schema version {version!r}; accepted: MAJOR.MINOR"
        ) from None
    if major not in C.SUPPORTED_MAJOR_VERSIONS:
        known = ", ".join(str(m) for m in sorted(C.SUPPORTED_MAJOR_VERSIONS))
        raise ValidationError(
            f"unknown schema major version {major} ({version}); accepted: {known}"
        )
    return version


def check_fields(schema: pa.Schema, version: str = C.STEPS_SCHEMA_VERSION) -> None:
    """Every contract column of schema `version` is in `schema` with its type (a 1.0 shard
    has no `won`): what a file's footer must say before any row is read."""
    required = C.steps_columns(version)
    missing = [name for name in required if name not in schema.names]
    if missing:
        raise ValidationError(f"missing column(s) of schema {version}: {', '.join(missing)}")
    for field in C.STEPS_SCHEMA:
        if field.name not in required and field.name not in schema.names:
            continue
        actual = schema.field(field.name).type
        if not actual.equals(field.type):
            raise ValidationError(f"column {field.name} has type {actual}; accepted: {field.type}")


def check_columns(table: pa.Table, version: str = C.STEPS_SCHEMA_VERSION) -> None:
    """`check_fields` of the table, and non-nullable columns hold no null."""
    check_fields(table.schema, version)
    for field in C.STEPS_SCHEMA:
        present = field.name in table.column_names
        if present and not field.nullable and table.column(field.name).null_count:
            raise ValidationError(f"column {field.name} holds nulls; it must not")


def check_rows(table: pa.Table) -> None:
    """Row-level rules: aligned action token lists, finite rewards."""
    ids_len = pc.list_value_length(table.column(C.ACTION_IDS))
    lp_len = pc.list_value_length(table.column(C.BEHAVIOR_LOGPROBS))
    bad = pc.not_equal(ids_len, lp_len)
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise ValidationError(
            f"action_ids and behavior_logprobs differ in length at row {row} "
            f"(traj_id {table.column(C.TRAJ_ID)[row].as_py()}, step {table.column(C.STEP)[row].as_py()})"
        )
    if C.WON in table.column_names:  # schema 1.1: a won rollout ended (a lost one may too)
        won_unended = pc.and_(table.column(C.WON), pc.invert(table.column(C.DONE)))
        if pc.any(won_unended).as_py():
            row = pc.index(won_unended, True).as_py()
            raise ValidationError(
                f"won without done at row {row} (traj_id {table.column(C.TRAJ_ID)[row].as_py()}, "
                f"step {table.column(C.STEP)[row].as_py()}); accepted: won only on a done step"
            )
    finite = pc.is_finite(table.column(C.REWARD))
    if not pc.all(finite).as_py():
        row = pc.index(finite, False).as_py()
        raise ValidationError(
            f"non-finite reward at row {row} (traj_id {table.column(C.TRAJ_ID)[row].as_py()}, "
            f"step {table.column(C.STEP)[row].as_py()})"
        )
    check_behavior_logprobs(table)
    check_policy_versions(table)


# A log-probability is <= 0; float rounding in an engine's log-softmax may leave a hair above.
LOGPROB_TOLERANCE = 1e-3
# A sampled token had a probability a float can hold: above 1e-45 in float32 (log > -104),
# 5e-324 in float64 (log > -745). Anything lower is no log-probability of a sampled token.
MIN_LOGPROB = -1000.0


def check_behavior_logprobs(table: pa.Table) -> None:
    """Behaviour log-probs are finite, <= 0 and above MIN_LOGPROB: NaN, ±inf, -1e30 or a
    positive "log-probability" would make the staleness weight of its action meaningless."""
    column = table.column(C.BEHAVIOR_LOGPROBS)
    values = pc.list_flatten(column)
    if len(values) == 0:
        return
    within = pc.and_(
        pc.less_equal(values, LOGPROB_TOLERANCE), pc.greater_equal(values, MIN_LOGPROB)
    )
    ok = pc.fill_null(pc.and_(pc.is_finite(values), within), False)
    if pc.all(ok).as_py():
        return
    first = pc.index(ok, False).as_py()
    ends = pc.cumulative_sum(pc.fill_null(pc.list_value_length(column), 0))
    row = pc.index(pc.greater(ends, first), True).as_py()
    raise ValidationError(
        f"behavior_logprobs holds {values[first].as_py()} at row {row} (traj_id "
        f"{table.column(C.TRAJ_ID)[row].as_py()}, step {table.column(C.STEP)[row].as_py()}); "
        f"accepted: finite log-probabilities in [{MIN_LOGPROB:g}, 0] (of sampled tokens)"
    )


def check_policy_versions(table: pa.Table, latest: int | None = None) -> None:
    """Policy versions are >= 0 and, when the reader knows the store's LATEST (`latest`;
    0 before the first publication), at most that: a shard from the future or with a
    negative version would give nonsense staleness."""
    bounds = pc.min_max(table.column(C.POLICY_VERSION))
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    if low is not None and low < 0:
        raise ValidationError(f"policy_version {low} is negative; accepted: versions >= 0")
    if latest is not None and high is not None and high > latest:
        raise ValidationError(
            f"policy_version {high} is newer than the store's LATEST (v{latest}); accepted: "
            f"versions 0..{latest} (a shard generated by a version that was published)"
        )


def check_groups(table: pa.Table, group_size: int | None) -> None:
    """Whole groups: G rollouts each, each rollout complete (steps 0..n-1, ended), versions
    that never decrease along a rollout."""
    per_traj = table.group_by([C.GROUP_ID, C.TRAJ_ID]).aggregate(
        [
            (C.STEP, "min"),
            (C.STEP, "max"),
            (C.STEP, "count_distinct"),
            (C.STEP, "count"),
        ]
    )
    smin, smax = per_traj.column(f"{C.STEP}_min"), per_traj.column(f"{C.STEP}_max")
    n_distinct, n = per_traj.column(f"{C.STEP}_count_distinct"), per_traj.column(f"{C.STEP}_count")
    contiguous = pc.and_(
        pc.and_(pc.equal(smin, 0), pc.equal(n_distinct, n)),
        pc.equal(pc.add(smax, 1), n),
    )
    if not pc.all(contiguous).as_py():
        i = pc.index(contiguous, False).as_py()
        raise ValidationError(
            f"rollout {per_traj.column(C.TRAJ_ID)[i].as_py()} does not hold steps 0..n-1 exactly once"
        )
    ended = pc.or_(table.column(C.DONE), table.column(C.TRUNCATED))
    last = pc.equal(
        table.column(C.STEP),
        _broadcast_max_step(table),
    )
    unended = pc.and_(last, pc.invert(ended))
    if pc.any(unended).as_py():
        i = pc.index(unended, True).as_py()
        raise ValidationError(
            f"rollout {table.column(C.TRAJ_ID)[i].as_py()} stops without done or truncated "
            "(an incomplete rollout)"
        )
    per_group = table.group_by(C.GROUP_ID).aggregate([(C.TRAJ_ID, "count_distinct")])
    if group_size is None:  # G is recorded per shard (docs/design.md §3, "Whole groups")
        raise ValidationError(
            f"no group size in file metadata (key {C.META_GROUP_SIZE.decode()}), so the shard "
            "cannot show that its groups are whole; accepted: a positive integer, the rollouts "
            "of each of its groups (Store.write_shard records it)"
        )
    sizes = per_group.column(f"{C.TRAJ_ID}_count_distinct")
    wrong = pc.not_equal(sizes, group_size)
    if pc.any(wrong).as_py():
        i = pc.index(wrong, True).as_py()
        raise ValidationError(
            f"group {per_group.column(C.GROUP_ID)[i].as_py()} has {sizes[i].as_py()} rollouts "
            f"in this shard; expected all {group_size} (a group must not be split)"
        )
    _check_versions_rise(table)


def _check_versions_rise(table: pa.Table) -> None:
    """A group may span policy versions (an actor with several groups in flight loads a new
    version between turns, docs/design.md §6), but along one rollout the version never falls:
    each step records the version that sampled it, and actors only move forward."""
    ordered = table.select([C.TRAJ_ID, C.STEP, C.POLICY_VERSION]).sort_by(
        [(C.TRAJ_ID, "ascending"), (C.STEP, "ascending")]
    )
    if ordered.num_rows < 2:
        return
    traj, version = ordered.column(C.TRAJ_ID), ordered.column(C.POLICY_VERSION)
    same = pc.equal(traj.slice(1), traj.slice(0, ordered.num_rows - 1))
    falls = pc.and_(same, pc.less(version.slice(1), version.slice(0, ordered.num_rows - 1)))
    if pc.any(falls).as_py():
        i = pc.index(falls, True).as_py() + 1
        raise ValidationError(
            f"rollout {traj[i].as_py()} goes back from policy version "
            f"{version[i - 1].as_py()} to {version[i].as_py()} at step {ordered.column(C.STEP)[i].as_py()}; "
            "accepted: versions that never decrease along a rollout"
        )


def _broadcast_max_step(table: pa.Table) -> pa.Array:
    """Each row's rollout length minus one, aligned with the table's rows."""
    per_traj = table.group_by(C.TRAJ_ID).aggregate([(C.STEP, "max")])
    index = pc.index_in(table.column(C.TRAJ_ID), value_set=per_traj.column(C.TRAJ_ID))
    return pc.take(per_traj.column(f"{C.STEP}_max"), index)


def group_size_of(metadata: dict[bytes, bytes] | None) -> int | None:
    """G from the file metadata (None when absent); anything but a positive integer is invalid."""
    raw = (metadata or {}).get(C.META_GROUP_SIZE)
    if raw is None:
        return None
    text = raw.decode(errors="replace").strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValidationError(
            f"metadata {C.META_GROUP_SIZE.decode()} is {raw!r}; accepted: a positive integer"
        )
    return int(text)


def check_not_empty(table: pa.Table) -> None:
    if table.num_rows == 0:
        raise ValidationError("the shard holds no rows; accepted: one or more whole groups")


def check_token_ids(table: pa.Table, vocab_size: int | None) -> None:
    """Token ids are never negative, and below `vocab_size` when the reader knows its
    vocabulary (the learner does: an id past it would index outside the embedding)."""
    for name in (C.PROMPT_IDS, C.ACTION_IDS):
        tokens = pc.list_flatten(table.column(name))
        if tokens.null_count:
            raise ValidationError(f"column {name} holds null token ids; it must not")
        if len(tokens) == 0:
            continue
        bounds = pc.min_max(tokens)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low < 0:
            raise ValidationError(f"column {name} holds token id {low}; accepted: ids >= 0")
        if vocab_size is not None and high >= vocab_size:
            raise ValidationError(
                f"column {name} holds token id {high}; accepted: ids below {vocab_size}, the "
                "vocabulary size of the policy being trained"
            )


def check_group_owners(table: pa.Table, shard_id: str, owner: Callable[[str], str | None]) -> None:
    """Group ids are globally unique (docs/design.md §3), so a group that `owner` says is
    already held by another shard makes this shard a later copy, or the second half of a
    split group: invalid. The reader decides what "already held" means (its ledger, its
    pending groups, the shards it read before)."""
    for group_id in table.column(C.GROUP_ID).unique().to_pylist():  # a few per shard
        other = owner(group_id)
        if other is not None and other != shard_id:
            raise ValidationError(
                f"group {group_id} is already in shard {other} (a group split over two shards, "
                "or a copy); accepted: each group whole in exactly one shard"
            )


def validate_footer(schema: pa.Schema) -> None:
    """The checks a file's footer alone allows (schema version, group size, the contract's
    columns and types): a reader of a few columns of a large file (an archive segment)
    runs these, never the row checks of the whole file."""
    try:
        group_size_of(schema.metadata)
        check_fields(schema, check_schema_version(schema.metadata))
    except ValidationError:
        raise
    except (pa.ArrowException, ValueError, TypeError, KeyError) as exc:
        raise ValidationError(f"malformed file ({describe(exc)})") from None


def validate_steps(
    table: pa.Table,
    metadata: dict[bytes, bytes] | None,
    *,
    vocab_size: int | None = None,
    latest: int | None = None,
) -> None:
    """All checks of a steps shard, in the order a reader needs them; `vocab_size`, when
    given, bounds the token ids, and `latest` (the store's LATEST) the policy versions."""
    try:
        version = check_schema_version(metadata)
        group_size = group_size_of(metadata)
        check_not_empty(table)
        check_columns(table, version)
        check_rows(table)
        check_token_ids(table, vocab_size)
        check_groups(table, group_size)
        check_policy_versions(table, latest)
    except ValidationError:
        raise
    except (pa.ArrowException, ValueError, TypeError, IndexError, KeyError) as exc:
        # A shape no check foresaw: still a reason, never a crash of the reader.
        raise ValidationError(f"malformed shard ({describe(exc)})") from None
