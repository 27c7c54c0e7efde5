"""Learner benchmark (issue #4), side by side in one run:

1. Update throughput: tokens/s of the learner's update (`run_update`: collation,
   length-bucketed micro-batches, the GAGPO loss and its metrics, gradient clipping,
   AdamW) against a bare forward+backward of the same model on the same micro-batches
   (the same left-padded tensors and `logits_to_keep`, a plain log-likelihood loss), and
   against a naive bare loop that computes logits for every position. Runs alternate
   and the medians are compared, so background load hits both sides alike.
2. Commit-to-use delay: the learner follows a store (in a thread) while shards are
   committed one by one; the delay from each shard's commit to the start of the update
   that trains on it, read from the learner's own metrics.
3. `--mode turns` (issue 38): full-history multi-turn data (step t's prompt holds steps
   0…t−1) at T turns; tokens encoded per update with turn merging, with one row per step
   (`merge_turns = false`), and each trajectory's tokens counted once; and the update time
   of both, alternating, medians.

    python benchmarks/bench_learner.py                        # a 4-layer, 256-wide Llama
    python benchmarks/bench_learner.py --mode turns           # T = 5, 20, 50
    python benchmarks/bench_learner.py --hidden 512 --layers 8 --groups 8 --repeats 5
    python benchmarks/bench_learner.py --policy /path/to/hf-folder
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gagpo.learner.batching import plan
from gagpo.learner.config import LearnerConfig
from gagpo.learner.dist import Dist
from gagpo.learner.metrics import read_metrics
from gagpo.learner.model import action_logprobs, load_model
from gagpo.learner.train import make_optimizer, run_update, train
from gagpo.schemas import columns as C
from gagpo.storage.store import Store
from tests.helpers.history import counted_once, full_history_batch
from tests.helpers.steps import make_steps


def build_model(folder: Path, vocab: int, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def batch_table(
    groups: int, vocab: int, seed: int, prompt: tuple[int, int], action: tuple[int, int]
) -> pa.Table:
    """BATCH_COLUMNS of `groups` groups (G = 8, rollouts of 2..9 turns) with random tokens."""
    steps = make_steps(shard_id=f"b{seed}", groups=groups, group_size=8, lengths=list(range(2, 10)))
    rng = np.random.default_rng(seed)
    n = steps.num_rows
    p_len, a_len = rng.integers(*prompt, n), rng.integers(*action, n)
    return pa.table(
        {
            C.SHARD_ID: steps[C.SHARD_ID],
            C.GROUP_ID: steps[C.GROUP_ID],
            C.TRAJ_ID: steps[C.TRAJ_ID],
            C.STEP: steps[C.STEP],
            C.PROMPT_IDS: pa.array(
                [rng.integers(3, vocab, k).tolist() for k in p_len], pa.list_(pa.int32())
            ),
            C.ACTION_IDS: pa.array(
                [rng.integers(3, vocab, k).tolist() for k in a_len], pa.list_(pa.int32())
            ),
            C.BEHAVIOR_LOGPROBS: pa.array(
                [(-rng.uniform(5, 9, k)).tolist() for k in a_len], pa.list_(pa.float32())
            ),
            C.POLICY_VERSION: pa.array(np.zeros(n, dtype=np.int64)),
            C.ADVANTAGE: pa.array(rng.normal(size=n)),
        }
    )


def bare_step(model, micro_batches, naive: bool) -> int:
    """Forward+backward of the same micro-batches with a plain log-likelihood loss."""
    for mb in micro_batches:
        if naive:  # logits for every position, the textbook way
            logits = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                use_cache=False,
            ).logits
            logp = logits[mb.token_rows, mb.token_cols].float().log_softmax(-1)
            targets = mb.input_ids[mb.token_rows, mb.token_cols + 1]
            loss = -logp.gather(-1, targets[:, None]).sum() / max(len(targets), 1)
        else:
            logp, _ = action_logprobs(model, mb, 1.0)
            loss = -(logp * mb.action_mask).sum() / mb.action_mask.sum()
        (loss * mb.weight).backward()
    model.zero_grad(set_to_none=True)
    return sum(mb.tokens for mb in micro_batches)


def bench_throughput(args, folder: Path) -> dict:
    model = load_model(folder, torch.device("cpu")).train()
    cfg = LearnerConfig(
        store="unused",
        policy=str(folder),
        micro_batch_tokens=args.micro_batch_tokens,
        batch_groups=args.groups,
        lr=1e-6,
    )
    optimizer, scheduler = make_optimizer(model, cfg)
    vocab = model.config.vocab_size
    table = batch_table(
        args.groups, vocab, 0, (args.prompt_min, args.prompt_max), (4, args.action_max)
    )
    d = Dist(0, 1, torch.device("cpu"))
    mbs = plan(
        table,
        version=1,
        pad_id=0,
        max_positions=4096,
        budget=cfg.micro_batch_tokens,
        token_mean=False,
    )
    times = {"learner": [], "bare": [], "naive": []}
    tokens = sum(mb.tokens for mb in mbs)
    for rep in range(args.repeats + 1):  # the first round warms up
        for name in ("bare", "learner", "naive"):
            start = time.perf_counter()
            if name == "learner":
                run_update(model, optimizer, scheduler, table, version=1, cfg=cfg, d=d, pad_id=0)
            else:
                bare_step(model, mbs, naive=name == "naive")
            if rep:
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "actions": table.num_rows,
        "tokens": tokens,
        "micro_batches": len(mbs),
        "padded_tokens": sum(mb.input_ids.numel() for mb in mbs),
        **{f"{k}_tok_s": tokens / v for k, v in med.items()},
        "overhead_vs_bare": med["learner"] / med["bare"] - 1,
        "overhead_vs_naive": med["learner"] / med["naive"] - 1,
    }


def bench_delay(args, folder: Path) -> dict:
    """Shards committed one at a time while the learner follows the store."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        cfg = LearnerConfig(
            store=tmp,
            policy=str(folder),
            updates=args.delay_shards,
            batch_groups=2,
            poll_interval_s=args.poll_interval,
            idle_timeout_s=60,
            keep_versions=2,
            max_staleness=1000,
            write_advantages=False,
        )
        learner = threading.Thread(target=train, args=(cfg,))
        learner.start()
        for i in range(args.delay_shards):
            time.sleep(args.delay_gap)
            table = make_steps(
                shard_id=f"d{i:03d}", run_id="bench", groups=2, group_size=4, lengths=[3, 4, 5, 6]
            )
            store.write_shard(table, group_size=4)
        learner.join()
        delays = read_metrics(store)["commit_to_use_s"].to_numpy()
    return {
        "shards": len(delays),
        "poll_interval_s": args.poll_interval,
        "delay_median_s": float(np.median(delays)),
        "delay_max_s": float(delays.max()),
    }


def bench_turns(args, folder: Path) -> list[dict]:
    """Per T: tokens encoded and update time, merged against one row per step. One
    optimiser per side, made once (AdamW's first step allocates its state: warm-up)."""
    base = load_model(folder, torch.device("cpu")).train()
    d = Dist(0, 1, torch.device("cpu"))
    sides = {}
    for merge in (True, False):
        cfg = LearnerConfig(
            store="unused",
            policy=str(folder),
            micro_batch_tokens=args.micro_batch_tokens,
            batch_groups=args.turn_groups,
            lr=1e-6,
            merge_turns=merge,
        )
        sides[merge] = (cfg, *make_optimizer(base, cfg))
    rows = []
    for turns in args.turns:
        table = full_history_batch(
            groups=args.turn_groups,
            group_size=args.group_size,
            turns=turns,
            vocab=base.config.vocab_size,
            system=args.system_tokens,
            observation=(args.turn_min, args.turn_max),
            action=(args.turn_min, args.turn_max),
        )
        warm_up = turns == args.turns[0]
        times, tokens = {True: [], False: []}, {}
        for rep in range(args.repeats + warm_up):
            for merge, (cfg, optimizer, scheduler) in sides.items():  # alternating
                start = time.perf_counter()
                stats, _ = run_update(
                    base, optimizer, scheduler, table, version=1, cfg=cfg, d=d, pad_id=0
                )
                if rep or not warm_up:
                    times[merge].append(time.perf_counter() - start)
                tokens[merge] = stats["tokens"]
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "turns": turns,
                "steps": table.num_rows,
                "once": counted_once(table),
                "merged": tokens[True],
                "per_step": tokens[False],
                "merged_s": med[True],
                "per_step_s": med[False],
            }
        )
    return rows


def print_turns(args, rows: list[dict]) -> None:
    print(
        f"# learner turn merging — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"{args.turn_groups} group(s) × {args.group_size} rollouts, medians of {args.repeats}"
    )
    print(
        "| turns | steps | tokens: per step | merged | counted once | merged / once "
        "| update s: per step | merged | speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['turns']} | {r['steps']} | {r['per_step']:,} | {r['merged']:,} | {r['once']:,} "
            f"| {r['merged'] / r['once']:.2f}× | {r['per_step_s']:.2f} | {r['merged_s']:.2f} "
            f"| {r['per_step_s'] / r['merged_s']:.1f}× |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy", help="a Hugging Face model folder (default: build a random Llama)"
    )
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--groups", type=int, default=4, help="B: groups (of 8 rollouts) per update"
    )
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--action-max", type=int, default=24)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--delay-shards", type=int, default=6)
    parser.add_argument("--delay-gap", type=float, default=1.5, help="seconds between two commits")
    parser.add_argument("--poll-interval", type=float, default=0.2)
    parser.add_argument("--mode", choices=["throughput", "turns"], default="throughput")
    turns = parser.add_argument_group("--mode turns")
    turns.add_argument(
        "--turns", type=lambda v: [int(t) for t in v.split(",")], default=[5, 20, 50]
    )
    turns.add_argument("--turn-groups", type=int, default=1, help="groups per update")
    turns.add_argument("--group-size", type=int, default=2, help="G: rollouts per group")
    turns.add_argument("--system-tokens", type=int, default=16, help="the first prompt's tokens")
    turns.add_argument(
        "--turn-min", type=int, default=2, help="fewest tokens of an action or observation"
    )
    turns.add_argument(
        "--turn-max", type=int, default=4, help="most tokens of an action or observation"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "turns":
        with tempfile.TemporaryDirectory() as tmp:
            folder = (
                Path(args.policy)
                if args.policy
                else build_model(Path(tmp), args.vocab, args.hidden, args.layers)
            )
            print_turns(args, bench_turns(args, folder))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = (
            Path(args.policy)
            if args.policy
            else build_model(Path(tmp), args.vocab, args.hidden, args.layers)
        )
        thr = bench_throughput(args, folder)
        delay = bench_delay(args, folder)
    print(
        f"# learner benchmark — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )
    print(
        f"model {thr['params_M']:.1f}M params; batch {args.groups} groups = {thr['actions']} actions, "
        f"{thr['tokens']} tokens in {thr['micro_batches']} micro-batches "
        f"({thr['padded_tokens'] / thr['tokens'] - 1:.1%} padding)"
    )
    print(f"learner update        {thr['learner_tok_s']:10.0f} tok/s")
    print(
        f"bare fwd+bwd          {thr['bare_tok_s']:10.0f} tok/s   learner overhead {thr['overhead_vs_bare']:+.1%}"
    )
    print(
        f"naive bare fwd+bwd    {thr['naive_tok_s']:10.0f} tok/s   learner vs naive {thr['overhead_vs_naive']:+.1%}"
    )
    print(
        f"commit → use delay: median {delay['delay_median_s']:.2f} s, max {delay['delay_max_s']:.2f} s "
        f"over {delay['shards']} shards (poll every {delay['poll_interval_s']} s)"
    )


if __name__ == "__main__":
    main()
