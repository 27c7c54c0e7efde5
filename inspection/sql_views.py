"""The SQL of the inspection views (inspection/sql.py opens the connection they live in).

Every view reads the registered sources of inspection/sql_sources.py (`_gagpo_<name>`) or
other views; `VIEWS` says what one row of each is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gagpo.inspection.sql_sources import ESTIMATOR
from gagpo.schemas import columns as C
from gagpo.schemas.extends import EXTENDS_SQL, SHARED_SQL, SLIDES_SQL, TRAJECTORY_KEY

# name -> what one row is; shown by `.views` in the interactive prompt and in docs.
VIEWS = {
    "steps": "one agent turn (steps table, schema v1.1; won_derived: a v1.0 row)",
    "advantages": "one step under one estimator tag (advantages table + estimator)",
    "estimators": "one advantage tag: estimator name, JSON parameters, shard files",
    "step_returns": "one step: discounted return-to-go at the session's gamma",
    "prompt_drift": "one step: does its prompt extend the previous step's prompt and action, or slide a window, or drift",
    "trajectories": "one rollout: return, success (= won), length, policy version",
    "groups": "one group: success rate, return spread, singleton states",
    "state_pools": "one (estimator, group, state): visits, its pool under the grouping, value proxy",
    "policy_versions": "one policy version: published, stored, pruned, is_latest, what it generated",
    "policy_loads": "one policy version one actor loaded: fetch seconds, the engine's pause",
    "learner_metrics": "one learner update: loss, KL, clipping, behaviour weights",
    "learner_histograms": "one bin of one learner histogram at one update",
    "heldout": "one evaluated policy version: success on the same held-out tasks",
}


def _return_block(gamma: float) -> int:
    """Block length B for the return-to-go window, with γ^B ≈ 1e-100.

    Within a block, powers γ^(k - block start) stay above 1e-100 and their inverses
    below 1e100, so nothing underflows however long the rollout; a term one whole
    block ahead or more is weighted by at most γ^B relative to the current reward and
    dropped, which is below double precision.
    """
    if gamma >= 1.0:
        return 2**31 - 1
    if gamma <= 0.0:
        return 1
    return max(1, math.floor(230.0 / -math.log(gamma)))


# The drift audit (issues 38, 47). Step t's prompt should begin with step t-1's prompt_ids +
# action_ids (`extends_previous`); where it does, the learner encodes both in one segment.
# Where it does not, the step is a window slide (a history window dropped its oldest turn:
# the previous prompt with one span cut, the rest kept, then the previous action) or drift
# (the reply did not survive the round trip through text and the template, a template
# rendered earlier turns afresh, or an agent edited its history). The rules are those of
# schemas/extends.py, in its SQL text. `shared_tokens` says how far the prompt follows the
# previous turn. Partitioned by the trajectory key (group, rollout), so a filter on
# group_id reaches the scans through the window (the group page of `gagpo view` reads one
# group). Its own view, not a column of `steps`: the window sorts every prompt, which a
# plain read of `steps` should never pay for.
PROMPT_DRIFT = f"""
    CREATE VIEW prompt_drift AS
    WITH turns AS (
        SELECT {C.RUN_ID}, {C.GROUP_ID}, {C.TRAJ_ID}, {C.STEP}, {C.ENV}, {C.POLICY_VERSION},
               {C.PROMPT_IDS} AS prompt,
               lag({C.PROMPT_IDS}) OVER trajectory AS previous_prompt,
               lag({C.ACTION_IDS}) OVER trajectory AS previous_action,
               lag({C.PROMPT_IDS} || {C.ACTION_IDS}) OVER trajectory AS previous
        FROM steps
        WINDOW trajectory AS (PARTITION BY {", ".join(TRAJECTORY_KEY)} ORDER BY {C.STEP})
    ), tested AS (
        SELECT *, {EXTENDS_SQL} AS extends_previous, {SHARED_SQL} AS shared
        FROM turns
    ), sorted AS (
        SELECT *, {SLIDES_SQL} AS window_slide FROM tested
    )
    SELECT {C.RUN_ID}, {C.GROUP_ID}, {C.TRAJ_ID}, {C.STEP}, {C.ENV}, {C.POLICY_VERSION},
           len(prompt) AS prompt_tokens,
           len(previous) AS previous_tokens,
           extends_previous,
           window_slide,
           NOT extends_previous AND NOT window_slide AS drift,
           CASE WHEN extends_previous THEN len(previous)
                WHEN NOT extends_previous THEN coalesce(
                    list_position(
                        list_transform(range(1, least(len(prompt), len(previous)) + 1),
                                       lambda i: prompt[i] != previous[i]),
                        true) - 1,
                    least(len(prompt), len(previous)))
           END AS shared_tokens
    FROM sorted
"""


# Schema 1.0 shards have no `won` (the scan reads it as NULL): derive it as success was read
# then, and say so in `won_derived` (schemas/columns.py, docs/inspect.md).
STEPS = f"""
    CREATE VIEW steps AS
    SELECT * REPLACE (coalesce({C.WON}, {C.WON_FROM_V1_0_SQL}) AS {C.WON}),
           {C.WON} IS NULL AS won_derived
    FROM _gagpo_steps
    """

# The views that show one registered source as it is stored, the estimator tag first.
PLAIN_SOURCES = (
    f"CREATE VIEW advantages AS SELECT {ESTIMATOR}, * EXCLUDE ({ESTIMATOR}) FROM _gagpo_advantages",
    "CREATE VIEW estimators AS SELECT * FROM _gagpo_estimators",
    "CREATE VIEW learner_metrics AS SELECT * FROM _gagpo_learner_metrics",
    "CREATE VIEW learner_histograms AS SELECT * FROM _gagpo_learner_histograms",
    "CREATE VIEW heldout AS SELECT * FROM _gagpo_heldout ORDER BY policy_version",
)

# The pause is what the engine lost to a version change: the drain and the load; the fetch
# ran beside generation (actors/prefetch.py).
POLICY_LOADS = """
    CREATE VIEW policy_loads AS
    SELECT run_id, version, fetch_s, drain_s, load_s, drain_s + load_s AS pause_s, loaded_at
    FROM _gagpo_policy_loads ORDER BY loaded_at, run_id
    """


def step_returns(gamma: float) -> str:
    """The `step_returns` view at discount γ = `gamma`.

    G_t = Σ_{k≥t} γ^(k−t) r_k, as a suffix sum within fixed blocks of B steps plus the next
    block's total (see _return_block): window sums only, exact for long rollouts.
    """
    g = f"{float(gamma)!r}::DOUBLE"
    block = _return_block(gamma)
    return f"""
    CREATE VIEW step_returns AS
    WITH blocked AS (
        SELECT group_id, traj_id, step, state_key, reward::DOUBLE AS reward,
               step // {block} AS block, step % {block} AS pos
        FROM steps
    ), suffix AS (
        SELECT *, sum(reward * pow({g}, pos)) OVER (
            PARTITION BY traj_id, block ORDER BY step
            ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS in_block
        FROM blocked
    ), block_totals AS (
        SELECT traj_id, block, sum(reward * pow({g}, pos) ORDER BY step) AS total
        FROM blocked GROUP BY traj_id, block
    )
    SELECT s.group_id, s.traj_id, s.step, s.state_key,
           pow({g}, -s.pos) * (s.in_block + pow({g}, {block}) * coalesce(b.total, 0))
               AS "return",
           {g} AS gamma
    FROM suffix s
    LEFT JOIN block_totals b ON b.traj_id = s.traj_id AND b.block = s.block + 1
    """


# One row per rollout, summed from its steps.
TRAJECTORIES = """
    CREATE VIEW trajectories AS
    SELECT run_id, shard_id, group_id, traj_id,
           any_value(env) AS env,
           any_value(task_id) AS task_id,
           min(policy_version) AS policy_version,
           count(*) AS length,
           sum(reward::DOUBLE ORDER BY step) AS "return",  -- in step order: bit for bit
           arg_max(won, step) AS success,
           bool_or(won_derived) AS won_derived,
           arg_max(truncated, step) AS truncated,
           count(*) FILTER (WHERE NOT action_valid) AS invalid_actions,
           min(created_at) AS started_at,
           max(created_at) AS ended_at
    FROM steps
    GROUP BY run_id, shard_id, group_id, traj_id
    """

# One row per group: its rollouts' success and return spread, and how many of its states
# were visited once (a singleton pool has no sibling to compare with).
GROUPS = """
    CREATE VIEW groups AS
    WITH pools AS (
        SELECT group_id, state_key, count(*) AS visits FROM steps GROUP BY group_id, state_key
    ), pool_counts AS (
        SELECT group_id, count(*) AS states,
               count(*) FILTER (WHERE visits = 1) AS singleton_states
        FROM pools GROUP BY group_id
    ), rollouts AS (
        SELECT group_id,
               any_value(run_id) AS run_id,
               any_value(shard_id) AS shard_id,
               any_value(env) AS env,
               any_value(task_id) AS task_id,
               min(policy_version) AS policy_version,
               count(*) AS rollouts,
               sum(length) AS steps,
               -- in rollout order: the same answer whatever the files' layout, bit for bit
               avg(success::DOUBLE ORDER BY traj_id) AS success_rate,
               avg("return" ORDER BY traj_id) AS mean_return,
               stddev_pop("return" ORDER BY traj_id) AS std_return,
               min("return") AS min_return,
               max("return") AS max_return,
               min(started_at) AS started_at
        FROM trajectories GROUP BY group_id
    )
    SELECT r.*, p.states, p.singleton_states,
           p.singleton_states / r.steps AS singleton_rate
    FROM rollouts r JOIN pool_counts p USING (group_id)
    """

# Value proxies from the stored advantages where a group has them (one row per estimator);
# otherwise from step_returns at this session's γ, with estimator NULL. One row per state;
# its pool (pool_id, under the tag's state_grouping: the state itself when exact) gives
# value_proxy and the return spread, as the stage used them.
STATE_POOLS = """
    CREATE VIEW state_pools AS
    WITH pooled AS (
        SELECT estimator, group_id, traj_id, step, state_key,
               coalesce(pool_id, state_key) AS pool_id, "return"
        FROM advantages
        UNION ALL
        SELECT NULL::VARCHAR AS estimator, r.group_id, r.traj_id, r.step, r.state_key,
               r.state_key AS pool_id, r."return"
        FROM step_returns r
        ANTI JOIN (SELECT DISTINCT group_id FROM advantages) a USING (group_id)
    ), pools AS (
        SELECT estimator, group_id, pool_id,
               count(*) AS pool_visits,
               count(DISTINCT state_key) AS pool_states,
               -- summed in (rollout, step) order: the same answer whatever the files'
               -- layout (shards or archive segments), bit for bit
               avg("return" ORDER BY traj_id, step) AS value_proxy,
               stddev_pop("return" ORDER BY traj_id, step) AS return_std,
               min("return") AS return_min,
               max("return") AS return_max
        FROM pooled GROUP BY estimator, group_id, pool_id
    ), states AS (
        SELECT estimator, group_id, state_key, any_value(pool_id) AS pool_id,
               count(*) AS visits, count(DISTINCT traj_id) AS trajectories
        FROM pooled GROUP BY estimator, group_id, state_key
    ), modes AS (
        SELECT estimator,
               coalesce(json_extract_string(params, '$.state_grouping'), 'exact') AS state_grouping
        FROM estimators
    )
    SELECT s.estimator, s.group_id, s.state_key, s.visits, s.trajectories,
           p.value_proxy, p.return_std, p.return_min, p.return_max,
           coalesce(m.state_grouping, 'exact') AS state_grouping, s.pool_id,
           p.pool_visits, p.pool_states
    FROM states s
    JOIN pools p ON p.estimator IS NOT DISTINCT FROM s.estimator
                AND p.group_id = s.group_id AND p.pool_id = s.pool_id
    LEFT JOIN modes m ON m.estimator = s.estimator
    """

# One row per policy version, in the policy registry (published, stored, pruned, latest:
# sql_sources.policy_table) or only seen in the steps, beside what the actors generated
# with it.
POLICY_VERSIONS = """
    CREATE VIEW policy_versions AS
    WITH generated AS (
        SELECT policy_version AS version,
               sum(length) AS steps,
               count(*) AS trajectories,
               count(DISTINCT group_id) AS groups,
               avg(success::DOUBLE ORDER BY traj_id) AS success_rate,
               avg("return" ORDER BY traj_id) AS mean_return,
               min(started_at) AS first_step_at,
               max(ended_at) AS last_step_at
        FROM trajectories GROUP BY policy_version
    )
    SELECT coalesce(p.version, g.version) AS version,
           coalesce(p.published, false) AS published,
           coalesce(p.stored, false) AS stored,
           coalesce(p.published AND NOT p.stored, false) AS pruned,
           coalesce(p.is_latest, false) AS is_latest,
           coalesce(g.steps, 0)::BIGINT AS steps,
           coalesce(g.trajectories, 0) AS trajectories,
           coalesce(g.groups, 0) AS groups,
           g.success_rate, g.mean_return, g.first_step_at, g.last_step_at
    FROM _gagpo_policy p FULL OUTER JOIN generated g ON p.version = g.version
    ORDER BY version
    """


def view_statements(gamma: float) -> Iterable[str]:
    """The CREATE VIEW statements of `VIEWS`, each after the views it reads; `gamma` is the
    session's discount, used by `step_returns` (and so by `state_pools` without advantages)."""
    yield STEPS
    yield from PLAIN_SOURCES
    yield POLICY_LOADS
    yield step_returns(gamma)
    yield PROMPT_DRIFT
    yield TRAJECTORIES
    yield GROUPS
    yield STATE_POOLS
    yield POLICY_VERSIONS
