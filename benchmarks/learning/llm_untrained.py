"""The untrained policy's success on guess_number, for a few settings (issue 45, step 1).

Each setting plays the same held-out tasks (task seed 900 000 000 on, as `gagpo run`'s
evaluation) with the actors' own loop (workflows/evaluate.py `play`): success, valid
replies, seconds. Usage:

    python benchmarks/learning/llm_untrained.py --groups 16 --settings "8-15:4:0" "10-19:3:0"

A setting is SIZES:TURNS:HISTORY_WINDOW[:hide], SIZES the range's fewest-most numbers;
`hide` turns the range off in the observations (only "higher" / "lower").
"""

from __future__ import annotations

import argparse
import time

from gagpo.actors.config import ActorConfig, SamplingConfig
from gagpo.workflows.evaluate import play


def setting(text: str) -> dict:
    sizes, turns, window, *rest = text.split(":")
    low, high = (int(x) for x in sizes.split("-"))
    return {
        "env_options": {"sizes": [low, high], "show_range": "hide" not in rest},
        "max_turns": int(turns),
        "history_window": int(window),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--seed", type=int, default=900_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=["8-15:4:0"])
    args = parser.parse_args()
    print("setting  rollouts  success  valid  seconds")
    for text in args.settings:
        config = ActorConfig(
            store="unused",
            env="guess_number",
            policy=args.policy,
            groups=args.groups,
            group_size=args.group_size,
            seed=args.seed,
            threads=args.threads,
            sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
            **setting(text),
        )
        start = time.perf_counter()
        out = play(config)
        print(
            f"{text}  {out['rollouts']}  {out['success_rate']:.1%}  {out['valid_rate']:.1%}  "
            f"{time.perf_counter() - start:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
