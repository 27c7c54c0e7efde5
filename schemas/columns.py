"""The column contract of docs/design.md §3: names, Arrow schemas and file metadata keys.

Column names are a public contract (users write SQL against them); every other
module refers to them through these constants, never by position.

Steps schema versions (minor versions add columns; a reader of 1.1 reads 1.0):
    1.0  the first contract.
    1.1  adds `won`: the rollout accomplished its task (true on its last step only).
         `done` only says the episode ended, lost games included. In 1.0 shards the
         outcome is derived as it was then: done with a positive last reward
         (`WON_FROM_V1_0_SQL` below; the SQL views flag such rows `won_derived`).
"""

from __future__ import annotations

import pyarrow as pa

from gagpo.schemas import layout

# Schema version of the steps table, stored in every shard's file metadata.
# Readers accept any minor version of a major version they know.
STEPS_SCHEMA_VERSION = "1.1"
SUPPORTED_MAJOR_VERSIONS = frozenset({1})

# File-metadata keys (Parquet key/value metadata).
META_SCHEMA_VERSION = b"gagpo.schema_version"
META_GROUP_SIZE = b"gagpo.group_size"
META_ESTIMATOR = b"gagpo.estimator"
META_ESTIMATOR_PARAMS = b"gagpo.estimator_params"
META_SOURCE = b"gagpo.source"  # what wrote a steps file: demonstration, segment (else actors)
# The learner's ledger (learner/ledger.parquet) carries in its metadata what actors need to
# throttle on its backlog (actors/throttle.py): its version after the last recorded update,
# its batch size B and its max_staleness.
META_LEARNER_VERSION = b"gagpo.learner_version"
META_BATCH_GROUPS = b"gagpo.batch_groups"
META_MAX_STALENESS = b"gagpo.max_staleness"
SHARD_GROUPS = "shard_groups"  # ledger column: how many groups the consumed group's shard holds

# --- steps table, schema v1: one row per agent turn ---------------------------------
RUN_ID = "run_id"
SHARD_ID = "shard_id"
GROUP_ID = "group_id"
TRAJ_ID = "traj_id"
STEP = "step"
ENV = "env"
TASK_ID = "task_id"
STATE_KEY = "state_key"
NEXT_STATE_KEY = "next_state_key"
OBSERVATION = "observation"
PROMPT_IDS = "prompt_ids"
ACTION_TEXT = "action_text"
ACTION_IDS = "action_ids"
BEHAVIOR_LOGPROBS = "behavior_logprobs"
POLICY_VERSION = "policy_version"
REWARD = "reward"
DONE = "done"
TRUNCATED = "truncated"
ACTION_VALID = "action_valid"
WON = "won"  # since 1.1
CREATED_AT = "created_at"

STEPS_SCHEMA = pa.schema(
    [
        pa.field(RUN_ID, pa.string(), nullable=False),
        pa.field(SHARD_ID, pa.string(), nullable=False),
        pa.field(GROUP_ID, pa.string(), nullable=False),
        pa.field(TRAJ_ID, pa.string(), nullable=False),
        pa.field(STEP, pa.int32(), nullable=False),
        pa.field(ENV, pa.string(), nullable=False),
        pa.field(TASK_ID, pa.string(), nullable=False),
        pa.field(STATE_KEY, pa.string(), nullable=False),
        pa.field(NEXT_STATE_KEY, pa.string(), nullable=True),
        pa.field(OBSERVATION, pa.string(), nullable=False),
        pa.field(PROMPT_IDS, pa.list_(pa.int32()), nullable=False),
        pa.field(ACTION_TEXT, pa.string(), nullable=False),
        pa.field(ACTION_IDS, pa.list_(pa.int32()), nullable=False),
        pa.field(BEHAVIOR_LOGPROBS, pa.list_(pa.float32()), nullable=False),
        pa.field(POLICY_VERSION, pa.int64(), nullable=False),
        pa.field(REWARD, pa.float32(), nullable=False),
        pa.field(DONE, pa.bool_(), nullable=False),
        pa.field(TRUNCATED, pa.bool_(), nullable=False),
        pa.field(ACTION_VALID, pa.bool_(), nullable=False),
        pa.field(WON, pa.bool_(), nullable=False),
        pa.field(CREATED_AT, pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)
STEPS_COLUMNS = tuple(STEPS_SCHEMA.names)
# Columns a minor version added: (major, minor) it appeared in. Older shards lack them.
ADDED_IN = {WON: (1, 1)}


def steps_columns(version: str) -> tuple[str, ...]:
    """The steps columns a shard of schema `version` ("MAJOR.MINOR") must hold."""
    major, _, minor = version.partition(".")
    have = (int(major), int(minor or 0))
    return tuple(name for name in STEPS_COLUMNS if ADDED_IN.get(name, have) <= have)


# SQL for `won` in a 1.0 shard, which has no such column: the episode ended (`done` is
# set on a rollout's last step only) with a positive reward, as success was read then.
WON_FROM_V1_0_SQL = f"({DONE} AND {REWARD} > 0)"

# The columns the advantage stage needs; plain Parquet inputs may carry only these.
ADVANTAGE_INPUT_COLUMNS = (
    GROUP_ID,
    TRAJ_ID,
    STEP,
    STATE_KEY,
    NEXT_STATE_KEY,
    REWARD,
    DONE,
    TRUNCATED,
)

# --- advantages table: keyed by (traj_id, step) --------------------------------------
RETURN = "return"
VALUE_PROXY = "value_proxy"
NEXT_VALUE_PROXY = "next_value_proxy"
TD_RESIDUAL = "td_residual"
ADVANTAGE_RAW = "advantage_raw"
ADVANTAGE = "advantage"
STATE_GROUP_SIZE = "state_group_size"

ADVANTAGES_SCHEMA = pa.schema(
    [
        pa.field(TRAJ_ID, pa.string(), nullable=False),
        pa.field(STEP, pa.int32(), nullable=False),
        pa.field(GROUP_ID, pa.string(), nullable=False),
        pa.field(STATE_KEY, pa.string(), nullable=False),
        pa.field(RETURN, pa.float64(), nullable=False),
        pa.field(VALUE_PROXY, pa.float64(), nullable=False),
        pa.field(NEXT_VALUE_PROXY, pa.float64(), nullable=False),
        pa.field(TD_RESIDUAL, pa.float64(), nullable=False),
        pa.field(ADVANTAGE_RAW, pa.float64(), nullable=False),
        pa.field(ADVANTAGE, pa.float64(), nullable=False),
        pa.field(STATE_GROUP_SIZE, pa.int64(), nullable=False),
    ]
)
ADVANTAGES_COLUMNS = tuple(ADVANTAGES_SCHEMA.names)


# --- learner metrics: STORE/learner/metrics/<update>.parquet, one row per update ------
# learner/histograms.zarr/<name>: int64 [updates, bins], bin edges in attrs["edges"]
# (the names are schemas/layout.py's: layout.metrics, layout.histograms)
LEARNER_METRICS_DIR = layout.METRICS
LEARNER_HISTOGRAMS = layout.HISTOGRAMS
_LEARNER_INT_METRICS = (
    "update",
    "version",
    "ratio_bounded",
    "skipped_steps",
    "masked_actions",
    "actions",
    "action_tokens",
    "tokens",
    "segments",
    "context_skipped",
    "tree_splits",
    "groups",
    "steps",
    "stale_groups",
    "stale_groups_total",
    "staleness_max",
    "bytes_written",
)
LEARNER_METRICS_COLUMNS = (
    "update",
    "version",
    "time",
    "loss",
    "pg_loss",
    "kl_ref",
    "entropy",
    "approx_kl",
    "clip_frac",
    "behavior_weight_mean",
    "behavior_weight_max",
    "ratio_bounded",
    "skipped_steps",
    "masked_actions",
    "actions",
    "action_tokens",
    "tokens",  # encoded (padding excluded)
    "segments",  # rows encoded: trajectory segments whose prompts extend each other
    "context_skipped",  # steps past the policy's context: left out of the loss, never cut
    "tree_token_ratio",  # prefix_trie: segment tokens ÷ trie tokens (NULL when off)
    "tree_splits",  # prefix_trie: trie rows past one per group, split at the budget
    "groups",
    "steps",
    "stale_groups",
    "stale_groups_total",
    "staleness_mean",
    "staleness_max",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "update_s",
    "wait_s",
    "commit_to_use_s",
    # behaviour/learner mismatch on actions of the learner's own version; NULL when none
    "mismatch_kl",
    "mismatch_max_abs",
    # the commit after the update, on the learner's critical path (learner/train.py)
    "publish_s",  # writing the version's policy folder
    "state_s",  # taking the training state when due (and waiting for the one before it)
    "bytes_written",  # the policy folder, plus the training states that finished writing
)
LEARNER_METRICS_SCHEMA = pa.schema(
    [
        pa.field(name, pa.int64() if name in _LEARNER_INT_METRICS else pa.float64())
        for name in LEARNER_METRICS_COLUMNS
    ]
)

# eval/heldout.parquet: one row per evaluated policy version, all on the same held-out tasks
# (`gagpo run` with [run] eval_groups, workflows/evaluate.py).
HELDOUT_SCHEMA = pa.schema(
    [
        ("policy_version", pa.int64()),
        ("rollouts", pa.int64()),
        ("success_rate", pa.float64()),
        ("valid_rate", pa.float64()),
        ("mean_return", pa.float64()),
        ("task_seed", pa.int64()),
    ]
)


def schema_major(version: str) -> int:
    """Major part of a "MAJOR.MINOR" schema version string."""
    return int(version.split(".", 1)[0])


# --- the learner's ledger: one row per consumed group (learner/feed.py) ---------------
# learner/ledger.parquet holds the groups not yet compacted; archive/ledger/ the others
# (storage/archive.py). `update` is the learner update that trained the group or dropped
# it as stale (`status`), `learner_version` the version it was measured against.
LEDGER_UPDATE, LEDGER_STATUS, LEDGER_LEARNER_VERSION = "update", "status", "learner_version"
LEDGER_SCHEMA = pa.schema(
    [
        pa.field(RUN_ID, pa.string(), nullable=False),
        pa.field(SHARD_ID, pa.string(), nullable=False),
        pa.field(GROUP_ID, pa.string(), nullable=False),
        pa.field(SHARD_GROUPS, pa.int64(), nullable=False),
        pa.field(POLICY_VERSION, pa.int64(), nullable=False),
        pa.field(LEDGER_UPDATE, pa.int64(), nullable=False),
        pa.field(LEDGER_LEARNER_VERSION, pa.int64(), nullable=False),
        pa.field(LEDGER_STATUS, pa.string(), nullable=False),
    ]
)
