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


def vocab_case(path: str, n: int, hidden: int) -> dict:
    """One log-prob pass (forward, with entropy, and backward) of `n` action tokens through
    a random 1-layer Qwen2 with Qwen2.5's vocabulary (151,936): its peak RSS above the RSS
    before it (sampled every 2 ms), in this process alone."""
    import gc

    import psutil
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).train()
    steps, prompt = 8, 64
    rng = np.random.default_rng(0)
    a = n // steps
    table = pa.table(
        {
            C.GROUP_ID: pa.array(["g"] * steps),
            C.TRAJ_ID: pa.array([f"t{i}" for i in range(steps)]),
            C.STEP: pa.array(np.zeros(steps, dtype=np.int32)),
            C.PROMPT_IDS: pa.array([rng.integers(3, 151_936, prompt).tolist()] * steps),
            C.ACTION_IDS: pa.array(
                [rng.integers(3, 151_936, a).tolist() for _ in range(steps)], pa.list_(pa.int64())
            ),
            C.BEHAVIOR_LOGPROBS: pa.array([[-1.0] * a] * steps, pa.list_(pa.float32())),
            C.POLICY_VERSION: pa.array(np.zeros(steps, dtype=np.int64)),
            C.ADVANTAGE: pa.array(np.ones(steps)),
        }
    )
    (mb,) = plan(table, version=0, pad_id=0, max_positions=32_768, budget=1 << 30, token_mean=False)
    proc, peak, done = psutil.Process(), [0], threading.Event()
    gc.collect()
    base = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    logp, entropy = action_logprobs(model, mb, 1.0, True, vocab_chunks=path == "chunked")
    (logp.sum() + entropy.sum()).backward()
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {
        "path": path,
        "tokens": int(mb.action_mask.sum()),
        "peak_mb": (peak[0] - base) / 2**20,
        "s": seconds,
    }


def bench_vocab(args) -> list[dict]:
    """Each (path, N) in its own process, so that no freed memory of one is counted in
    another. The full path is measured only where its logits (fp32 N × V, several copies)
    fit in the free memory with room to spare."""
    import json
    import subprocess

    import psutil

    rows = []
    for n in args.vocab_tokens:
        for path in ("full", "chunked"):
            need = 4 * n * 151_936 * 5  # about five [N, V] fp32 tensors at once
            if path == "full" and need > 0.6 * psutil.virtual_memory().available:
                rows.append({"path": path, "tokens": n, "peak_mb": None, "s": None})
                continue
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--vocab-case",
                    f"{path}:{n}",
                    "--hidden",
                    str(args.hidden),
                ],
                capture_output=True,
                text=True,
            )
            if run.returncode:  # killed (memory) or failed: said, and the table goes on
                print(f"{path} at {n} tokens failed: {run.stderr[-300:]}", file=sys.stderr)
                rows.append({"path": path, "tokens": n, "peak_mb": None, "s": None})
                continue
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return rows


def print_vocab(args, rows: list[dict]) -> None:
    print(
        f"# log-prob pass memory — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"torch {torch.__version__}; random 1-layer Qwen2, hidden {args.hidden}, V = 151,936; "
        "forward with entropy + backward; peak RSS above the RSS before the pass"
    )
    print("| action tokens | full: peak MB | s | chunked: peak MB | s | full / chunked |")
    print("|---:|---:|---:|---:|---:|---:|")
    by = {(r["path"], r["tokens"]): r for r in rows}
    for n in args.vocab_tokens:
        f, c = by.get(("full", n)), by.get(("chunked", n))
        fm = f"{f['peak_mb']:,.0f}" if f and f["peak_mb"] is not None else "not run / failed"
        fs = f"{f['s']:.1f}" if f and f["s"] is not None else "–"
        ratio = f"{f['peak_mb'] / c['peak_mb']:.1f}×" if f and f["peak_mb"] else "–"
        print(f"| {n:,} | {fm} | {fs} | {c['peak_mb']:,.0f} | {c['s']:.1f} | {ratio} |")


def alfworld_table(args) -> pa.Table:
    """ALFWorld steps as the issue measured them: the tiny policy, 2 groups × 8 rollouts of
    15 turns, history window 2 (gagpo-actors into a temporary store unless --trie-store
    names one), with random advantages (they change no token count or time)."""
    import glob
    import subprocess

    import pyarrow.parquet as pq

    from gagpo.learner.feed import BATCH_COLUMNS

    with tempfile.TemporaryDirectory() as tmp:
        store = args.trie_store or str(Path(tmp) / "store")
        if not args.trie_store:
            command = [sys.executable, "-m", "gagpo.actors.cli", "--quiet", "--store", store]
            command += ["--env", "alfworld", "--policy", "tiny", "--groups", "2"]
            command += ["--group-size", "8", "--max-turns", "15", "--history-window", "2"]
            subprocess.run([*command, "--run-id", "r", "--seed", "0"], check=True)
        steps = pq.read_table(sorted(glob.glob(f"{store}/shards/*/*.parquet")))
    rng = np.random.default_rng(0)
    steps = steps.append_column(C.ADVANTAGE, pa.array(rng.normal(size=steps.num_rows)))
    return steps.select(list(BATCH_COLUMNS))


def trie_scenarios(args, vocab: int) -> dict[str, pa.Table]:
    """The issue's ALFWorld batch, a tool agent's (one 1.2k-token system prompt per group,
    rollouts parting at their first reply), and groups that share nothing (each rollout
    its own system prompt): random ids below the model's `vocab`."""
    from tests.helpers.shared_prefix import shared_batch

    agent = dict(system=(1200, 1200), observation=(30, 100), action=(10, 40))
    return {
        "ALFWorld, 2 × 8 × 15 turns, window 2": alfworld_table(args),
        "tool agent, 2 × 8 × 4 turns, 1.2k-token system prompt": shared_batch(
            groups=2, group_size=8, turns=4, choices=1 << 30, vocab=vocab, **agent
        ),
        "no shared state, 2 × 8 × 10 turns": full_history_batch(
            groups=2,
            group_size=8,
            turns=10,
            vocab=vocab,
            system=200,
            observation=(20, 60),
            action=(5, 20),
        ),
    }


def bench_trie(args, folder: Path) -> list[dict]:
    """Per scenario: tokens encoded by segments and by the tries against the tries'
    distinct prefixes, the planning time of each, and the update time of each
    (alternating, medians; one optimiser per side, the first update a warm-up)."""
    from gagpo.learner import trie

    base = load_model(folder, torch.device("cpu")).train()
    args.kappa = trie.pair_cost(base.config) if args.trie_kappa == "auto" else None
    if args.kappa is None:  # the update's layout too: rows filled up to the budget
        trie.pair_cost = lambda config: None
    d = Dist(0, 1, torch.device("cpu"))
    sides = {}
    for tree in (False, True):
        cfg = LearnerConfig(
            store="unused",
            policy=str(folder),
            micro_batch_tokens=args.micro_batch_tokens,
            batch_groups=2,
            lr=1e-6,
            prefix_trie=tree,
        )
        sides[tree] = (cfg, *make_optimizer(base, cfg))
    rows = []
    kw = dict(version=1, pad_id=0, max_positions=4096, budget=args.micro_batch_tokens)
    for k, (name, table) in enumerate(trie_scenarios(args, base.config.vocab_size).items()):
        start = time.perf_counter()
        plan(table, token_mean=False, **kw)
        plan_s = {False: time.perf_counter() - start}
        start = time.perf_counter()
        _, stats = trie.plan(table, token_mean=False, kappa=args.kappa, **kw)
        plan_s[True] = time.perf_counter() - start
        times = {False: [], True: []}
        for rep in range(args.repeats + (k == 0)):
            for tree, (cfg, optimizer, scheduler) in sides.items():  # alternating
                start = time.perf_counter()
                run_update(base, optimizer, scheduler, table, version=1, cfg=cfg, d=d, pad_id=0)
                if rep or k:
                    times[tree].append(time.perf_counter() - start)
        med = {key: statistics.median(v) for key, v in times.items()}
        rows.append(
            {
                "scenario": name,
                "steps": table.num_rows,
                "segment_tokens": stats.segment_tokens,
                "trie_tokens": stats.tokens,
                "distinct": stats.distinct,
                "splits": stats.splits,
                "plan_s": plan_s,
                "update_s": med,
            }
        )
    return rows


def print_trie(args, rows: list[dict]) -> None:
    print(
        f"# learner prefix trie — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"{args.policy or f'random Llama {args.layers} layers × {args.hidden}'}, micro-batch "
        f"budget {args.micro_batch_tokens}, medians of {args.repeats}; κ = {args.kappa or 'none (rows by the budget only)'}"
    )
    print(
        "| scenario | steps | tokens: segments | trie | distinct prefixes | trie / distinct "
        "| splits | plan s: segments | trie | update s: segments | trie | speed-up |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        u, p = r["update_s"], r["plan_s"]
        print(
            f"| {r['scenario']} | {r['steps']} | {r['segment_tokens']:,} | {r['trie_tokens']:,} "
            f"| {r['distinct']:,} | {r['trie_tokens'] / r['distinct']:.3f}× | {r['splits']} "
            f"| {p[False]:.3f} | {p[True]:.3f} | {u[False]:.2f} | {u[True]:.2f} "
            f"| {u[False] / u[True]:.2f}× |"
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
    parser.add_argument(
        "--mode", choices=["throughput", "turns", "vocab", "trie"], default="throughput"
    )
    parser.add_argument(
        "--trie-kappa",
        choices=["auto", "none"],
        default="auto",
        help="--mode trie: rows joined where cheaper for this model (auto, as the learner "
        "does) or filled up to the budget (none)",
    )
    parser.add_argument(
        "--trie-store", help="--mode trie: a store holding the ALFWorld steps (default: play them)"
    )
    vocab = parser.add_argument_group("--mode vocab")
    vocab.add_argument(
        "--vocab-tokens",
        type=lambda v: [int(t) for t in v.split(",")],
        default=[1024, 2048, 4096, 8192],
        help="action tokens of the log-prob pass",
    )
    vocab.add_argument("--vocab-case", help=argparse.SUPPRESS)  # PATH:N, one measurement
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
    if args.vocab_case:
        import json

        path, n = args.vocab_case.split(":")
        print(json.dumps(vocab_case(path, int(n), args.hidden)))
        return
    if args.mode == "vocab":
        print_vocab(args, bench_vocab(args))
        return
    if args.mode == "trie":
        with tempfile.TemporaryDirectory() as tmp:
            folder = (
                Path(args.policy)
                if args.policy
                else build_model(Path(tmp), args.vocab, args.hidden, args.layers)
            )
            print_trie(args, bench_trie(args, folder))
        return
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
