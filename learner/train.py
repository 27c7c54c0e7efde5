"""The learner's main loop; one update is learner/update.py (docs/design.md §4).

Per update, in this order: ledger → the previous version's publication finished → the
training state, when due (every `state_every` updates: copied and handed to a writer
thread) → the version's weights copied in the published dtype → metrics (with the
commit's costs: publish_s, state_s, bytes_written) → the copy handed to the publishing
thread, which writes the folder, then moves LATEST (learner/publish.py, `Publisher`), while
the next update runs. `--resume` continues from LATEST (learner/checkpoint.py), so
versions form one lineage across kills.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import torch

from gagpo.learner import faults
from gagpo.learner.checkpoint import has_learner_state, read_lineage, start
from gagpo.learner.compact import Compactor
from gagpo.learner.config import LearnerConfig
from gagpo.learner.dist import (
    Dist,
    barrier,
    broadcast_table,
    close_dist,
    init_dist,
    is_sharded,
    owned_weights,
    shard_model,
)
from gagpo.learner.feed import BATCH_COLUMNS, TRAINED, Batch, Feed, Ledger, pipeline_advantages
from gagpo.learner.lease import release_lease
from gagpo.learner.metrics import MetricsLog, group_staleness, staleness_counts
from gagpo.learner.model import add_lora, load_model, resolve_policy
from gagpo.learner.preflight import check_start
from gagpo.learner.publish import (
    Publisher,
    Shards,
    VersionCopy,
    point_latest,
    take_weights,
    write_version,
)
from gagpo.learner.state import Head, StateWriter, prune_states, snapshot_state
from gagpo.learner.update import HISTOGRAMS, run_update
from gagpo.schemas import columns as C
from gagpo.storage.store import Store


def make_optimizer(model: torch.nn.Module, cfg: LearnerConfig):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    total = cfg.updates * cfg.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg))
    return optimizer, scheduler


def lr_factor(step: int, total: int, cfg: LearnerConfig) -> float:
    """lr(step) / lr for optimiser step `step` (0-based) of `total`: linear warm-up over
    `warmup_steps`, then `lr_schedule` from 1 down to `lr_final` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(total - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    decay = (
        0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    )
    return cfg.lr_final + (1 - cfg.lr_final) * decay


# --- the loop ----------------------------------------------------------------------------


@dataclass
class LearnerSummary:
    updates: int = 0  # total, across restarts
    version: int = 0  # the newest published version
    groups: int = 0  # trained in this run
    stale_groups: int = 0
    rejected_shards: int = 0
    tokens: int = 0
    stopped: str | None = None  # why the run ended before `updates`, in one line
    compactions: int = 0  # archive generations this run committed


def make_feed(
    store: Store, ledger: Ledger, cfg: LearnerConfig, vocab_size: int | None = None
) -> Feed:
    from gagpo.pipeline.recompute import advantages_metadata

    estimator = cfg.estimator
    metadata = advantages_metadata(estimator)  # as `gagpo advantages` writes them

    def keep_advantages(ref, advantages) -> None:
        table = advantages.to_arrow().cast(C.ADVANTAGES_SCHEMA)
        store.write_parquet(table, store.advantages_path(estimator.tag, ref.shard_id), metadata)

    return Feed(
        store,
        ledger,
        pipeline_advantages(estimator),
        batch_groups=cfg.batch_groups,
        max_staleness=None if cfg.replay or cfg.mode == "sft" else cfg.max_staleness,
        source=Store(cfg.replay) if cfg.replay else None,
        follow=cfg.replay is None,
        poll_interval_s=cfg.poll_interval_s,
        idle_timeout_s=cfg.idle_timeout_s,
        on_advantages=keep_advantages if cfg.write_advantages else None,
        vocab_size=vocab_size,  # shards with token ids past the model's are quarantined
        replay_order=replay_order(cfg),
    )


def replay_order(cfg: LearnerConfig) -> list[str] | None:
    """With replay_as_of_update U: the groups the replayed store's learner trained in
    updates ≤ U, in the order it trained them (its ledger), so batches of the same B are
    its batches."""
    if cfg.replay is None or cfg.replay_as_of_update is None:
        return None
    from gagpo.storage.archive import groups_as_of

    rows = groups_as_of(Store(cfg.replay), cfg.replay_as_of_update)
    trained = rows.filter(pc.equal(rows[C.LEDGER_STATUS], TRAINED))
    return trained[C.GROUP_ID].to_pylist()


def metrics_row(
    update, version, batch: Batch, stats: dict, feed: Feed, t_wait, t0, t1, costs=None
) -> dict:
    """The metrics of `update`, which published `version`: its batch was formed at the
    version before, and its staleness is measured there (schemas.policy.staleness);
    `costs` are its commit's (`Trainer.take_version`)."""
    staleness = group_staleness(batch, version - 1)
    return (
        stats
        | (costs or {})
        | {
            "update": update,
            "version": version,
            "time": t1,
            "groups": len(batch.groups),
            "steps": batch.steps.height,
            "stale_groups": len(batch.stale),
            "stale_groups_total": feed.stats.groups_stale,
            "staleness_mean": float(staleness.mean()),
            "staleness_max": int(staleness.max()),
            "tokens_per_s": stats["tokens"] / max(t1 - t0, 1e-9),
            "update_s": t1 - t0,
            "wait_s": t0 - t_wait,
            "commit_to_use_s": float(np.mean([t0 - g.committed_at for g in batch.groups])),
        }
    )


def histograms(counts: dict, batch: Batch, version: int, max_staleness: int) -> dict:
    """Histogram rows with their bin edges; staleness has one bin per version behind, then
    one counting the groups dropped as stale."""
    out = {k: (v, HISTOGRAMS[k].edges) for k, v in counts.items()}
    out["staleness"] = (
        staleness_counts(batch, version, max_staleness),
        list(range(max_staleness + 2)),
    )
    return out


@dataclass
class Trainer:
    """The model, optimiser and store of one learner process, built once from the config,
    and how each version it trains leaves it: `take_version` (the weights, and the
    training state when due) then `release_version` (to the publishing thread, or LATEST)."""

    cfg: LearnerConfig
    dist: Dist
    store: Store
    base_dir: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: torch.nn.Module | None

    @classmethod
    def build(cls, cfg: LearnerConfig, d: Dist, echo=None) -> Trainer:
        torch.manual_seed(cfg.seed)
        store = Store(cfg.store)
        check_start(cfg)  # nothing to wait for: fail now (the CLI ran it before importing torch)
        if d.main:
            store.ensure_writable()
        base_dir = resolve_policy(
            cfg.policy,
            Store(cfg.replay) if cfg.replay else store,
            poll_s=cfg.poll_interval_s,
            wait_s=0.0 if cfg.replay else cfg.idle_timeout_s,  # a replay store has v0 or never will
            echo=echo if d.main else None,
        )
        model = load_model(base_dir, d.device)
        if cfg.lora.enabled:
            lora = cfg.lora
            add_lora(model, lora.rank, lora.alpha, lora.target_modules, lora.dropout)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        if cfg.parallel == "fsdp" and d.world > 1:
            # before the optimiser: it must hold the sharded parameters
            shard_model(model, cfg.precision)
        ref = (
            load_model(base_dir, d.device).eval().requires_grad_(False)
            if cfg.loss.kl_coef
            else None
        )
        return cls(cfg, d, store, base_dir, model, *make_optimizer(model, cfg), ref)

    writer: StateWriter | None = None  # the main rank's; every rank's under FSDP
    publisher: Publisher | None = None  # the main rank's; every rank's under FSDP
    state_version: int = 0  # the newest version whose training state was taken
    # the version `take_version` copied, for `release_version` to hand to the thread
    pending: VersionCopy | None = None

    def __post_init__(self) -> None:
        cfg = self.cfg
        lora = cfg.lora.enabled  # LoRA: state and version written at once, every update
        if self._takes_part:  # under FSDP every rank writes its own file of each state
            asynchronous = cfg.state_async and not lora
            self.writer = StateWriter(
                self.store, cfg.keep_checkpoints, asynchronous=asynchronous, prune=self.dist.main
            )
        if self._takes_part:  # and of each version
            self.publisher = Publisher(
                self.store,
                self.model,
                self.base_dir,
                cfg.keep_versions,
                cfg.keep_every,
                asynchronous=cfg.publish_async and not lora,
                delta_every=cfg.publish_delta_every,
            )

    @property
    def _takes_part(self) -> bool:
        """Publication and states are collectives under FSDP; otherwise rank 0's alone."""
        return self.dist.main or is_sharded(self.model)

    @property
    def publish_dtype(self) -> torch.dtype | None:
        """None: the master weights' own dtype (fp32)."""
        wanted = self.cfg.publish_dtype
        if wanted == "auto":
            wanted = "bf16" if self.cfg.precision == "bf16" else "fp32"
        return torch.bfloat16 if wanted == "bf16" else None

    def state_due(self, update: int, last: bool) -> bool:
        return last or self.cfg.lora.enabled or update % self.cfg.state_every == 0

    def publishes_in_thread(self, last: bool) -> bool:
        """The version goes to the writer thread (the run's last, and LoRA's, at once)."""
        return self.cfg.publish_async and not self.cfg.lora.enabled and not last

    # Called by every rank: under FSDP each writes its own tensors; otherwise rank 0 alone.
    def take_version(
        self, head: Head, update: int, ledger: Ledger | None, last: bool
    ) -> tuple[Head, dict]:
        """Take the child of `head` made by `update`: wait for the previous version's
        publication (LATEST is then `head`), take the training state when due, then the
        weights, copied in the published dtype for the thread that `release_version` hands them to,
        or written at once (the run's last version, LoRA, publish_async = false). Returns
        the child and the costs on the critical path: publish_s (that wait, and the copy
        or the write), state_s (taking the state, and waiting for the previous one),
        bytes_written (this folder when written at once, and the folders and states
        finished since the last call)."""
        child = head.child(update)
        costs = {"publish_s": 0.0, "state_s": 0.0, "bytes_written": 0}
        if not self._takes_part:
            return child, costs
        t0 = time.perf_counter()
        if self.publisher is not None:
            self.publisher.wait()
        t1 = time.perf_counter()
        if self.state_due(update, last):
            self._save_state(child.version, child.record(head), ledger)
        t2 = time.perf_counter()
        written = self._take_version(child, child.record(head), update, last)
        t3 = time.perf_counter()
        costs["publish_s"], costs["state_s"] = (t1 - t0) + (t3 - t2), t2 - t1
        if self.dist.main:
            written += self.publisher.take_bytes() + self.writer.take_bytes()
        costs["bytes_written"] = written
        return child, costs

    def _take_version(self, child: Head, record: dict, update: int, last: bool) -> int:
        """The weights of `child` copied for the thread (`pending`), or its folder written
        now; returns the bytes written now."""
        lora = self.cfg.lora if self.cfg.lora.enabled else None
        if lora is not None and lora.publish == "adapter":
            return write_version(
                self.store,
                self.model,
                self.base_dir,
                child.version,
                lora,
                main=self.dist.main,
                lineage=record,
            )
        in_thread = self.publishes_in_thread(last)
        shards = None
        if is_sharded(self.model):  # each rank takes the tensors it owns, whole
            if self.dist.main:  # an earlier attempt that never completed
                self.store.remove(self.store.policies.dir(child.version), recursive=True)
            barrier(self.dist)
            weights, owners = owned_weights(self.model, self.dist, self.publish_dtype)
            shards = Shards(self.dist.rank, self.dist.world, owners)
        else:
            weights = take_weights(
                self.model, main=self.dist.main, dtype=self.publish_dtype, copy=in_thread
            )
            if not self.dist.main:
                return 0
        version = VersionCopy(child.version, update, weights, record, self.publish_dtype, shards)
        if in_thread:
            self.pending = version
            return 0
        return self.publisher.write(version)

    def _save_state(self, version: int, record: dict, ledger: Ledger | None) -> None:
        snapshot = snapshot_state(
            self.store,
            version,
            record,
            self.model,
            self.optimizer,
            self.scheduler,
            ledger,
            main=self.dist.main,
            copy_tensors=self.writer is not None and self.writer.asynchronous,
        )
        if snapshot is not None:
            self.writer.save(snapshot)
        self.state_version = version

    def release_version(self, child: Head) -> None:
        """Once `child`'s metrics row is written: its copy handed to the writer thread,
        which writes the folder, then points LATEST at it; or, written at once by
        `take_version`, LATEST → `child` now. Then the versions are pruned."""
        if self.pending is not None:
            version, self.pending = self.pending, None
            self.publisher.publish(version)
        elif self.dist.main:
            point_latest(self.store, child.version, self.cfg.keep_versions, self.cfg.keep_every)

    def finish(self, head: Head, ledger: Ledger | None) -> None:
        """At the end of a run: the state of `head` (LATEST) when the newest one is older,
        and every state written, so that --resume continues exactly. The version in flight,
        if any, is published first: a state never names an unpublished version."""
        if self.publisher is not None:
            self.publisher.close()
        if self._takes_part and self.state_version != head.version:
            record = read_lineage(self.store, head.version) if self.dist.main else {}
            self._save_state(head.version, record, ledger)
        if self.writer is not None:
            self.writer.wait()
        if self.dist.main:
            prune_states(self.store, self.cfg.keep_checkpoints)


def _archive(feed: Feed, result) -> None:
    """Groups a finished compaction archived leave the tail ledger at its next commit."""
    if result is not None and result.groups_archived:
        feed.ledger.archive(result.groups_archived)
        feed.forget_bytes()


def train(cfg: LearnerConfig, echo=None) -> LearnerSummary:
    """Run the learner until `cfg.updates` updates are done (or the data runs out)."""
    d = init_dist(cfg.device)
    t = Trainer.build(cfg, d, echo)
    say = echo or (lambda line: print(line, file=sys.stderr))
    head, ledger = _resume_head(t, say)
    loop = _Loop.open(t, head, ledger, echo)
    summary = LearnerSummary()
    while loop.update < cfg.updates:
        if not loop.step(summary):
            break
    loop.close(summary)
    summary.updates, summary.version = loop.update, loop.version
    if d.main:
        release_lease(t.store)  # the next learner may take the store at once
    close_dist(d)
    return summary


def _resume_head(t: Trainer, say) -> tuple[Head, Ledger | None]:
    """The head the run continues from (LATEST under --resume, else v0) and its ledger."""
    cfg, d = t.cfg, t.dist
    nothing_to_resume = cfg.resume and d.main and not has_learner_state(t.store)
    head, ledger = start(
        t.store,
        resume=cfg.resume,
        model=t.model,
        optimizer=t.optimizer,
        scheduler=t.scheduler,
        main=d.main,
        steps_per_update=cfg.mini_batches,
        say=say,
    )
    t.state_version = head.version  # a resumed run writes no state before its first update
    if nothing_to_resume:  # documented: --resume on a store no learner published to starts at v0
        say(f"--resume: store {cfg.store} holds no learner state yet; starting fresh from v0")
    return head, ledger


@dataclass
class _Loop:
    """The update loop's moving parts: the feed, metrics log and compactor live on rank 0
    (None elsewhere); `head` is the newest version taken, `update`/`version` its counters."""

    t: Trainer
    head: Head
    feed: Feed | None
    log: MetricsLog | None
    compactor: Compactor | None
    pad_id: int

    @property
    def update(self) -> int:
        return self.head.update

    @property
    def version(self) -> int:
        return self.head.version

    @classmethod
    def open(cls, t: Trainer, head: Head, ledger: Ledger | None, echo) -> _Loop:
        cfg, main = t.cfg, t.dist.main
        vocab_size = getattr(t.model.config, "vocab_size", None)
        feed = make_feed(t.store, ledger, cfg, vocab_size) if main else None
        if main:
            feed.announce(head.version)  # B and max_staleness reach the actors' throttle
        log = MetricsLog.for_config(t.store, cfg, echo=echo, start=head.update) if main else None
        # the archive's single writer is this learner (it holds the lease); never on a replay
        compactor = Compactor(t.store, cfg.compaction, echo) if main and not cfg.replay else None
        pad_id = getattr(t.model.config, "pad_token_id", None) or 0
        return cls(t, head, feed, log, compactor, pad_id)

    def step(self, summary: LearnerSummary) -> bool:
        """One update: the batch, the optimiser steps, then the ledger, the version taken
        (and the state when due), its metrics row, and the version released to LATEST
        (module docstring). False once the feed has no batch left."""
        t, cfg, d, feed = self.t, self.t.cfg, self.t.dist, self.feed
        t_wait = time.time()
        batch = feed.next_batch(self.version, self.update + 1) if d.main else None  # rank 0 reads
        table = broadcast_table(batch.steps.select(BATCH_COLUMNS).to_arrow() if batch else None, d)
        if table is None:
            return False
        t0 = time.time()
        faults.set_update(self.update + 1)
        stats, hists = run_update(
            t.model,
            t.optimizer,
            t.scheduler,
            table,
            version=self.version,
            cfg=cfg,
            d=d,
            pad_id=self.pad_id,
            ref_model=t.ref_model,
        )
        stats["lr"] = t.scheduler.get_last_lr()[0]
        update, trained = self.update + 1, self.version
        if d.main:
            feed.commit(batch, update, trained)
        t1 = time.time()
        last = update == cfg.updates
        child, costs = t.take_version(self.head, update, feed.ledger if d.main else None, last)
        if d.main:
            self.log.write(
                metrics_row(update, child.version, batch, stats, feed, t_wait, t0, t1, costs),
                histograms(hists, batch, trained, cfg.max_staleness),
            )
            summary.groups += len(batch.groups)
        t.release_version(child)
        self.head = child
        summary.tokens += stats["tokens"]
        if self.compactor is not None:  # off the critical path: a thread, collected later
            _archive(feed, self.compactor.collect())
            self.compactor.maybe_start(feed.ledger.table, update, feed.consumed_bytes())
        return True

    def close(self, summary: LearnerSummary) -> None:
        """The last state and publication, the log, the compaction in flight, and the
        ledger's final commit (groups dropped since the last batch)."""
        t, feed = self.t, self.feed
        t.finish(self.head, feed.ledger if t.dist.main else None)
        if not t.dist.main:
            return
        self.log.close()
        if self.compactor is not None:
            _archive(feed, self.compactor.collect(wait=True))
            summary.compactions = self.compactor.compactions
        feed.commit(None, self.update, self.version)
        summary.stopped = feed.stop_reason if self.update < t.cfg.updates else None
        summary.stale_groups = feed.stats.groups_stale
        summary.rejected_shards = feed.stats.shards_rejected
