"""What state grouping does (pipeline/grouping.py): singleton share, credit AUC, time.

Three measurements, printed as Markdown (and written as JSON with --json):

  shares  per environment, noisy expert plays (noise 0.3, G = 8, 6 groups; the expert's
          plan with a uniformly random admissible command in 30 % of turns), the share of
          steps after the first turn whose pool is a single step, under every mode.
          Environments: the built-ins (sokoban, household, webshop, and alfworld /
          textworld where their extras are installed); `rooms`, a Gymnasium-style
          environment through the adapter keyed by its observation text (which carries
          a turn counter and the last action, as many Gym text envs do); and
          `webshop-queries`, WebShop whose search queries are rewritten the way a
          policy's free text varies (a word dropped, words swapped, a filler word added).
  credit  Sokoban only (the exact solver is its oracle): AUC of GAGPO's advantage for
          optimal moves (benchmarks/learning/credit.py) under every mode, same plays.
  time    the advantage stage on ~1 M synthetic steps (bench_advantages.synthetic_steps)
          whose keys are observation-like text with a turn counter, under every mode,
          the best of --repeat runs each, against exact.

    python benchmarks/bench_grouping.py                        # all three, 1 M steps
    python benchmarks/bench_grouping.py --only shares credit   # no timing
    python benchmarks/bench_grouping.py --steps 200000 --only time
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

from gagpo.actors.demos import Expert
from gagpo.pipeline import compute_advantages, parse_estimator_config
from gagpo.schemas import columns as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "learning"))

MODES = ("exact", "normalized", "similar:0.9", "similar:0.8", "minhash:0.8", "minhash:0.6")
BUILT_IN = ("sokoban", "household", "webshop", "alfworld", "textworld")


# --- a Gym-style environment keyed by its observation text ---------------------------


class Rooms:
    """A corridor of rooms; the key is at the end. Gymnasium-style (reset/step with
    info); the observation repeats the turn number and the last action, so as text it
    almost never repeats across rollouts although the underlying state (room) does."""

    ROOMS = ("hall", "library", "kitchen", "cellar", "attic", "garden")

    def __init__(self, size: int = len(ROOMS)):
        """`size`: rooms in the corridor (2 to 6); the key is `size` − 1 moves east."""
        self.size = max(2, min(int(size), len(self.ROOMS)))

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.order = list(self.ROOMS[: self.size])
        random.Random(seed).shuffle(self.order)
        self.at, self.turn, self.last = 0, 0, "none"
        return self._obs(), {
            "admissible_commands": ["go east", "go west", "look"],
            "expert_plan": ["go east"] * (len(self.order) - 1),
        }

    def _obs(self) -> str:
        room = self.order[self.at]
        return (
            f"Turn {self.turn}. Last action: {self.last}. You are in the {room}. "
            f"Exits lead east and west. Find the key in the {self.order[-1]}."
        )

    def step(self, action):
        self.turn += 1
        self.last = action
        if action == "go east":
            self.at = min(self.at + 1, len(self.order) - 1)
        elif action == "go west":
            self.at = max(self.at - 1, 0)
        won = self.at == len(self.order) - 1
        info = {"admissible_commands": ["go east", "go west", "look"], "won": won}
        return self._obs(), (1.0 if won else 0.0), won, False, info


def make(name: str, max_turns: int):
    if name == "rooms":
        from gagpo.envs.gym_adapter import GymAdapter

        return GymAdapter(Rooms(), name="rooms", max_turns=max_turns, state_key="observation")
    from gagpo.envs import make_env

    return make_env("webshop" if name == "webshop-queries" else name, max_turns)


def rewrite_query(text: str, rng: random.Random) -> str:
    """search[a b c] as a policy might vary it: drop, swap or add a word."""
    words = text[len("search[") : -1].split()
    roll = rng.random()
    if roll < 0.3 and len(words) > 1:
        words.pop(rng.randrange(len(words)))
    elif roll < 0.6 and len(words) > 1:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    elif roll < 0.9:
        words.insert(rng.randrange(len(words) + 1), rng.choice(["cheap", "new", "best", "for"]))
    return f"search[{' '.join(words)}]"


def plays(
    name: str,
    groups: int = 6,
    size: int = 8,
    noise: float = 0.3,
    max_turns: int = 30,
    seed: int = 0,
) -> pl.DataFrame:
    """Noisy expert rollouts as a steps table (the columns the stage and credit.py read).
    A loop over turns of a simulator, not over stored rows: this is the data source."""
    rows = []
    for g in range(groups):
        rng = random.Random(seed * 1000 + g)
        expert = Expert(policy=None, noise=noise, rng=rng)
        envs = [make(name, max_turns) for _ in range(size)]  # alive: plans are per id(env)
        for i, env in enumerate(envs):
            start = env.reset(task_seed=seed * 1000 + g)
            admissible = start.admissible
            for t in range(max_turns):
                text = expert.choose(env, admissible)
                if name == "webshop-queries" and text.startswith("search["):
                    text = rewrite_query(text, rng)
                tr = env.step(text)
                rows.append(
                    {
                        C.GROUP_ID: f"{name}-{g}",
                        C.TRAJ_ID: f"{name}-{g}-{i}",
                        C.STEP: t,
                        C.STATE_KEY: tr.state_key,
                        C.NEXT_STATE_KEY: tr.next_state_key,
                        C.REWARD: float(tr.reward),
                        C.DONE: tr.done,
                        C.TRUNCATED: tr.truncated or (t == max_turns - 1 and not tr.done),
                        C.ACTION_TEXT: text,
                        C.POLICY_VERSION: 0,
                    }
                )
                if tr.done or tr.truncated:
                    break
                admissible = tr.admissible
    frame = pl.DataFrame(rows)
    return frame.with_columns(pl.col(C.STEP).cast(pl.Int32), pl.col(C.REWARD).cast(pl.Float32))


def advantages(steps: pl.DataFrame, mode: str, estimator: str = "gagpo") -> pl.DataFrame:
    config = parse_estimator_config({"estimator": estimator, "state_grouping": mode})
    return compute_advantages(steps.select(C.ADVANTAGE_INPUT_COLUMNS), config).collect()


def singleton_share(steps: pl.DataFrame, table: pl.DataFrame) -> float:
    """Share of steps after the first turn whose pool holds that step alone."""
    later = steps[C.STEP] > 0
    return float((table.filter(later)[C.STATE_GROUP_SIZE] == 1).mean())


def shares(envs: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for name in envs:
        try:
            steps = plays(name)
        except Exception as exc:  # an extra that is not installed: say so, go on
            print(
                f"  {name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                file=sys.stderr,
            )
            continue
        out[name] = {m: singleton_share(steps, advantages(steps, m)) for m in MODES}
        out[name]["steps"] = steps.height
    return out


def credit_auc() -> dict[str, float]:
    from credit import auc, label

    steps = plays("sokoban", groups=24)
    labels = label(steps)
    result = {}
    for mode in MODES:
        table = advantages(steps, mode).join(labels, on=[C.TRAJ_ID, C.STEP])
        result[mode] = auc(table[C.ADVANTAGE].to_numpy(), table["optimal"].to_numpy())
    result["labelled_steps"] = labels.height
    return result


def timing(n_steps: int, modes: tuple[str, ...] = MODES, repeat: int = 1) -> dict[str, float]:
    from bench_advantages import synthetic_steps

    steps = synthetic_steps(n_steps)
    # observation-like text: a turn counter and the state, as a Gym text env shows them
    text = "Turn {}. You are in the old house, room {}. A table, a lamp and {} doors."
    keyed = steps.with_columns(
        pl.format(
            text,
            pl.col(C.STEP),
            pl.col(C.STATE_KEY).str.extract(r"at=(\d+-\d+)"),
            pl.col(C.STATE_KEY).str.len_chars() % 5,
        ).alias(C.STATE_KEY),
        pl.when(pl.col(C.NEXT_STATE_KEY).is_not_null())
        .then(
            pl.format(
                text,
                pl.col(C.STEP) + 1,
                pl.col(C.NEXT_STATE_KEY).str.extract(r"at=(\d+-\d+)"),
                pl.col(C.NEXT_STATE_KEY).str.len_chars() % 5,
            )
        )
        .alias(C.NEXT_STATE_KEY),
    )
    out = {"steps": keyed.height}
    for mode in modes:
        config = parse_estimator_config({"state_grouping": mode})
        best = float("inf")
        for _ in range(repeat):  # the best of `repeat` runs: shared machines are noisy
            start = time.perf_counter()
            table = compute_advantages(keyed.lazy(), config).collect(engine="in-memory")
            best = min(best, time.perf_counter() - start)
        out[mode] = best
        out[f"{mode} singleton share"] = float((table[C.STATE_GROUP_SIZE] == 1).mean())
        print(f"  {mode}: {out[mode]:.2f} s", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("shares", "credit", "time"),
        default=["shares", "credit", "time"],
    )
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--time-modes",
        nargs="+",
        default=list(MODES),
        help="modes to time (similar:τ is a Python per-group map: slow at 1 M)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="time each mode N times, keep the best"
    )
    args = parser.parse_args()
    results: dict = {}
    if "shares" in args.only:
        results["shares"] = shares([*BUILT_IN, "rooms", "webshop-queries"])
        print("| env | steps | " + " | ".join(MODES) + " |")
        print("|---|---|" + "---|" * len(MODES))
        for env, row in results["shares"].items():
            cells = " | ".join(f"{100 * row[m]:.1f} %" for m in MODES)
            print(f"| {env} | {row['steps']} | {cells} |")
    if "credit" in args.only:
        results["credit"] = credit_auc()
        print("\n| sokoban GAGPO AUC | " + " | ".join(MODES) + " |")
        print("|---|" + "---|" * len(MODES))
        print(
            f"| {results['credit']['labelled_steps']} labelled steps | "
            + " | ".join(f"{results['credit'][m]:.3f}" for m in MODES)
            + " |"
        )
    if "time" in args.only:
        results["time"] = t = timing(args.steps, tuple(args.time_modes), args.repeat)
        print(f"\n| mode | seconds ({t['steps']} steps) | × exact | singleton share |")
        print("|---|---|---|---|")
        for m in args.time_modes:
            print(
                f"| {m} | {t[m]:.2f} | {t[m] / t['exact']:.2f} | {100 * t[m + ' singleton share']:.1f} % |"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
