"""A straightforward per-group Python implementation of every estimator.

It reads like docs/design.md §4: loop over groups, over rollouts, backwards over steps, with
plain floats and dicts. It is the oracle the tests compare `compute_advantages` with and
the baseline the benchmark measures it against; it does not validate its input and is
not meant for production use.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable
from typing import Any

from gagpo.schemas import columns as C

Row = dict[str, Any]


def _std(vs: list[float], ddof: int = 0) -> float:
    """Population std, or Bessel-corrected with ddof = 1 (0 for a single value)."""
    mean = sum(vs) / len(vs)
    return math.sqrt(sum((v - mean) ** 2 for v in vs) / max(len(vs) - ddof, 1))


def _normalise(
    values: dict[Hashable, float],
    scope: dict[Hashable, Hashable],
    norm: str,
    eps: float,
    *,
    verl_agent: bool = False,
) -> dict[Hashable, float]:
    """§4.5 over the samples sharing a scope (a group, or the whole batch); with
    `verl_agent`, as verl-agent's episode_norm_reward: sample std, and a scope of one
    sample gets mean 0 and std 1."""
    if norm == "none":
        return dict(values)
    members: dict[Hashable, list[float]] = defaultdict(list)
    for key, v in values.items():
        members[scope[key]].append(v)
    stats = {}
    for s, vs in members.items():
        if verl_agent and len(vs) == 1:
            stats[s] = (0.0, 1.0)
        else:
            stats[s] = (sum(vs) / len(vs), _std(vs, 1 if verl_agent else 0))
    if norm == "mean":
        return {k: v - stats[scope[k]][0] for k, v in values.items()}
    return {k: (v - stats[scope[k]][0]) / (stats[scope[k]][1] + eps) for k, v in values.items()}


def _group_columns(rollouts: dict[str, list[Row]], gamma: float, lam: float | None) -> list[Row]:
    """return, value proxy, next value, pool size, TD residual (and GAE with λ) of one group."""
    returns: dict[tuple[str, int], float] = {}
    for traj, steps in rollouts.items():
        g = 0.0
        for row in reversed(steps):  # G_t = r_t + γ·G_{t+1}
            g = float(row[C.REWARD]) + gamma * g
            returns[(traj, row[C.STEP])] = g
    pools: dict[str, list[float]] = defaultdict(list)
    for traj, steps in rollouts.items():
        for row in steps:
            pools[row[C.STATE_KEY]].append(returns[(traj, row[C.STEP])])
    value = {state: sum(gs) / len(gs) for state, gs in pools.items()}

    out = []
    for traj, steps in rollouts.items():
        gae = 0.0
        for i in range(len(steps) - 1, -1, -1):
            row = steps[i]
            if i + 1 < len(steps):
                next_value = value[steps[i + 1][C.STATE_KEY]]
            elif row[C.DONE]:
                next_value = 0.0
            else:  # truncated: bootstrap when the group has been in the next state
                next_value = value.get(row[C.NEXT_STATE_KEY], 0.0)
            delta = float(row[C.REWARD]) + gamma * next_value - value[row[C.STATE_KEY]]
            if lam is not None:
                gae = delta + gamma * lam * gae  # Â_t = δ_t + γλ·Â_{t+1}
            pool = pools[row[C.STATE_KEY]]
            out.append(
                {
                    C.TRAJ_ID: traj,
                    C.STEP: row[C.STEP],
                    C.GROUP_ID: row[C.GROUP_ID],
                    C.STATE_KEY: row[C.STATE_KEY],
                    C.RETURN: returns[(traj, row[C.STEP])],
                    C.VALUE_PROXY: value[row[C.STATE_KEY]],
                    C.NEXT_VALUE_PROXY: next_value,
                    C.TD_RESIDUAL: delta,
                    C.STATE_GROUP_SIZE: len(pool),
                    "gae": gae,
                    "pool_std": _std(pool),
                    "pool_sample_std": _std(pool, ddof=1),
                    "episode_return": sum(float(r[C.REWARD]) for r in steps),
                }
            )
    return out


def reference_advantages(rows: list[Row], config: Any) -> list[Row]:
    """The advantages table of `rows` (dicts with the input columns), one dict per step."""
    groups: dict[str, dict[str, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[row[C.GROUP_ID]][row[C.TRAJ_ID]].append(row)
    lam = getattr(config, "lam", None)
    out: list[Row] = []
    for rollouts in groups.values():
        for steps in rollouts.values():
            steps.sort(key=lambda r: r[C.STEP])
        out.extend(_group_columns(rollouts, config.gamma, lam))

    def scope(res: Row) -> Hashable:
        return "batch" if config.norm == "batch" else res[C.GROUP_ID]

    by_step = {(r[C.TRAJ_ID], r[C.STEP]): r for r in out}
    by_rollout = {r[C.TRAJ_ID]: r for r in out}  # one (any) row per rollout
    step_scope = {k: scope(r) for k, r in by_step.items()}
    rollout_scope = {t: scope(r) for t, r in by_rollout.items()}
    rollout_group = {t: r[C.GROUP_ID] for t, r in by_rollout.items()}
    episode = {t: r["episode_return"] for t, r in by_rollout.items()}

    name = config.estimator
    if name.startswith("gagpo"):
        raw = {k: r["gae"] for k, r in by_step.items()}
        adv = _normalise(raw, step_scope, config.norm, config.eps)
        if config.omega_episode:
            grpo = _normalise(episode, rollout_group, "group", config.eps)
            adv = {k: a + config.omega_episode * grpo[k[0]] for k, a in adv.items()}
    elif name == "gigpo":
        verl = getattr(config, "variant", "paper") == "verl_agent"
        raw = {}
        for k, r in by_step.items():
            step_adv = r[C.RETURN] - r[C.VALUE_PROXY]
            std = r["pool_sample_std"] if verl else r["pool_std"]
            raw[k] = step_adv / (std + config.eps) if config.step_std else step_adv
        if verl:  # the episode return of every step row, normalised over step rows
            per_step = {k: episode[k[0]] for k in by_step}
            episode_adv = _normalise(per_step, step_scope, config.norm, config.eps, verl_agent=True)
            adv = {k: episode_adv[k] + config.omega * raw[k] for k in by_step}
        else:
            episode_adv = _normalise(episode, rollout_scope, config.norm, config.eps)
            adv = {k: episode_adv[k[0]] + config.omega * raw[k] for k in by_step}
    elif name in ("grpo", "rloo"):
        if name == "grpo":
            per_rollout = dict(episode)
        else:
            members: dict[Hashable, list[str]] = defaultdict(list)
            for t, g in rollout_group.items():
                members[g].append(t)
            per_rollout = {}
            for t, g in rollout_group.items():
                others = [episode[o] for o in members[g] if o != t]
                per_rollout[t] = episode[t] - sum(others) / len(others) if others else 0.0
        normed = _normalise(per_rollout, rollout_scope, config.norm, config.eps)
        raw = {k: per_rollout[k[0]] for k in by_step}
        adv = {k: normed[k[0]] for k in by_step}
    else:
        raise ValueError(f"unknown estimator {name!r}")

    for k, r in by_step.items():
        r[C.ADVANTAGE_RAW] = raw[k]
        r[C.ADVANTAGE] = adv[k]
        for scratch in ("gae", "pool_std", "pool_sample_std", "episode_return"):
            del r[scratch]
    return out
