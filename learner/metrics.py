"""Per-update metrics: a Parquet row per update and zarr histograms, under `learner/`.

learner/metrics/<update:08d>.parquet   one row (METRIC_COLUMNS), rewritten if a
                                       resumed run redoes that update
learner/histograms.zarr/<name>         int64 [updates, bins]; row u−1 is update u;
                                       bin edges in the array's attributes
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from gagpo.schemas import columns as C
from gagpo.schemas import layout
from gagpo.schemas.policy import staleness
from gagpo.storage.store import Store

# Columns of a metrics row, in order (loss terms as returned by `gagpo_loss`).
METRIC_COLUMNS = C.LEARNER_METRICS_COLUMNS


@dataclass(frozen=True)
class Histogram:
    """Fixed bins (so that updates and processes add up): `bins` between `low` and `high`,
    values outside counted in the first and last bin."""

    low: float
    high: float
    bins: int = 40

    @property
    def edges(self) -> list[float]:
        return np.linspace(self.low, self.high, self.bins + 1).tolist()

    def counts(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Counts per bin of `values` (those where `mask`; NaN never), on their device:
        masked rather than indexed, so no device sync."""
        values = values.detach().double()
        keep = ~values.isnan() if mask is None else ~values.isnan() & mask.bool()
        scaled = (values.clamp(self.low, self.high) - self.low) * self.bins / (self.high - self.low)
        index = torch.where(keep, scaled, torch.zeros_like(scaled)).floor().long()
        index = index.clamp(0, self.bins - 1).flatten()
        out = torch.zeros(self.bins, dtype=torch.long, device=values.device)
        return out.scatter_add_(0, index, keep.flatten().long())


def group_staleness(batch, version: int) -> np.ndarray:
    """The staleness of each group of a batch formed at learner `version` (the version
    before its update), measured on the group's oldest step."""
    return staleness(version, np.array([g.policy_version for g in batch.groups], dtype=np.int64))


def staleness_counts(batch, version: int, max_staleness: int) -> np.ndarray:
    """Groups of a batch formed at `version` per staleness 0..S (larger values, as in
    replay, fall in S), then the groups dropped as stale while it was formed."""
    lag = group_staleness(batch, version)
    counts = np.bincount(np.clip(lag, 0, max_staleness), minlength=max_staleness + 1)
    return np.append(counts, len(batch.stale)).astype(np.int64)


class MetricsLog:
    """Writes metrics rows and histogram rows into the store, passes each row to the tracker
    sinks (learner/sinks.py), and prints a progress line with n/N and the time left."""

    def __init__(
        self,
        store: Store,
        *,
        echo=None,
        sinks=(),
        total: int | None = None,
        start: int = 0,
        not_computed: tuple[str, ...] = (),
        clip_possible: bool = True,
    ) -> None:
        self.store, self.echo, self.sinks = store, echo, list(sinks)
        self.total, self.start, self.t0 = total, start, time.time()
        self.not_computed, self.clip_possible = not_computed, clip_possible
        self._group = None

    @classmethod
    def for_config(cls, store: Store, cfg, *, echo=None, start: int = 0) -> MetricsLog:
        """The log of a learner run: its trackers, and what its settings leave uncomputed."""
        from gagpo.learner.sinks import default_log_dir, open_sinks

        sinks = []
        if cfg.log_to:
            log_dir = (
                Path(cfg.log_dir) if cfg.log_dir else default_log_dir(store.root, store.is_local)
            )
            name = f"{Path(store.root.rstrip('/')).name}-{time.strftime('%Y%m%d-%H%M%S')}"
            sinks = open_sinks(
                cfg.log_to, log_dir, run_name=name, config=cfg.model_dump(mode="json")
            )
        return cls(
            store,
            echo=echo,
            sinks=sinks,
            total=cfg.updates,
            start=start,
            not_computed=not_computed(cfg),
            clip_possible=clip_possible(cfg),
        )

    def _zarr(self):
        import zarr

        if self._group is None:
            if self.store.is_local:
                self._group = zarr.open_group(layout.histograms(self.store.root), mode="a")
            else:
                from zarr.storage import FsspecStore

                url = layout.histograms(self.store.url)
                self._group = zarr.open_group(FsspecStore.from_url(url), mode="a")
        return self._group

    def write(self, row: dict, histograms: dict[str, tuple[np.ndarray, list[float]]]) -> None:
        row = row | dict.fromkeys(self.not_computed)  # NULL, not 0: nothing was computed
        update = int(row["update"])
        table = pa.Table.from_pylist(
            [{k: row.get(k) for k in METRIC_COLUMNS}], schema=C.LEARNER_METRICS_SCHEMA
        )
        self.store.write_parquet(table, layout.metrics(self.store.root, update), {})
        self.store.retrying(
            f"writing {layout.histograms(self.store.url)} row {update}",
            lambda: self._write_histograms(update, histograms),
        )
        if self.sinks:
            from gagpo.learner.sinks import scalars

            metrics = scalars({k: row.get(k) for k in METRIC_COLUMNS if k != "update"})
            for sink in self.sinks:
                sink.log(metrics, update)
        if self.echo is not None:
            self.echo(progress_line(row, self.total, self.eta_s(update), self.clip_possible))

    def _write_histograms(self, update: int, histograms: dict) -> None:
        """Row `update` of every histogram array: idempotent, so a retry after an outage
        rewrites the same row (from a group opened afresh)."""
        try:
            self._write_rows(update, histograms)
        except Exception:
            self._group = None
            raise

    def _write_rows(self, update: int, histograms: dict) -> None:
        group = self._zarr()
        for name, (counts, edges) in histograms.items():
            counts = np.asarray(counts, dtype=np.int64)
            if name in group and group[name].shape[1] == len(counts):
                array = group[name]
            else:  # first update, or the bin count changed (max_staleness in a new config)
                array = group.create_array(
                    name,
                    shape=(0, len(counts)),
                    chunks=(1, len(counts)),
                    dtype="int64",
                    overwrite=True,
                )
                array.attrs["edges"] = edges
            if array.shape[0] < update:
                array.resize((update, len(counts)))
            array[update - 1] = counts

    def eta_s(self, update: int) -> float | None:
        """Seconds left at this run's pace so far (None before the first update)."""
        done = update - self.start
        if self.total is None or done <= 0:
            return None
        return (time.time() - self.t0) / done * max(self.total - update, 0)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def not_computed(cfg) -> tuple[str, ...]:
    """Metrics a learner config never computes: stored as NULL, left out of trackers."""
    out = []
    if not cfg.loss.entropy_coef:
        out.append("entropy")
    if not cfg.loss.kl_coef:
        out.append("kl_ref")
    return tuple(out)


def clip_possible(cfg) -> bool:
    """Whether π_θ can differ from π_prox in the loss: with one mini-batch and no bypass the
    first (only) optimiser step sees π_θ = π_prox, so clip_frac and approx_kl are 0 by
    construction (dropout aside) and the console leaves them out."""
    return cfg.loss.bypass or cfg.mini_batches > 1


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(
    row: dict, total: int | None = None, eta_s: float | None = None, clip: bool = True
) -> str:
    """The console line of one update: the quantities that can move at these settings."""
    parts = [f"update {row['update']}{f'/{total}' if total else ''} → v{row['version']}"]
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    parts.append(f"loss {row['loss']:+.4f}")
    if row.get("entropy") is not None:
        parts.append(f"entropy {row['entropy']:.3f}")
    if row.get("kl_ref") is not None:
        parts.append(f"kl_ref {row['kl_ref']:.2e}")
    parts.append(f"staleness {row['staleness_mean']:.1f} (max {row['staleness_max']})")
    parts.append(f"w̄ {row['behavior_weight_mean']:.3f} (max {row['behavior_weight_max']:.2f})")
    if row.get("mismatch_kl") is not None:
        parts.append(f"mismatch {row['mismatch_kl']:.1e}")
    if clip:
        parts.append(f"clip {row['clip_frac']:.3f}  kl {row['approx_kl']:.1e}")
    parts.append(f"|g| {row['grad_norm']:.3g}  lr {row['lr']:.1e}  {row['tokens_per_s']:.0f} tok/s")
    if row.get("segments") is not None:  # turn merging: rows encoded for the batch's steps
        parts.append(f"{row['segments']} rows for {row['steps']} steps")
    if row.get("tree_token_ratio") is not None:  # prefix_trie: segment tokens ÷ trie tokens
        parts.append(f"trie {row['tree_token_ratio']:.2f}× (splits {row['tree_splits']})")
    parts.append(f"groups {row['groups']} (stale dropped {row['stale_groups']})")
    if row.get("context_skipped"):
        parts.append(f"past context {row['context_skipped']}")
    if row.get("masked_actions"):
        parts.append(f"masked {row['masked_actions']}")
    if row.get("publish_s") is not None:  # the commit's critical path (learner/train.py)
        parts.append(
            f"publish {row['publish_s']:.2f} s  state {row['state_s']:.2f} s  "
            f"{row['bytes_written'] / 2**20:.1f} MiB"
        )
    return "  ".join(parts)


def read_metrics(store: Store):
    """All metrics rows as a Polars DataFrame, ordered by update."""
    import polars as pl

    paths = sorted(
        p
        for p in store.glob(layout.metrics(store.root, "*"))
        if layout.parse_metrics(p) is not None
    )  # not a killed write's temporary
    if not paths:
        return pl.DataFrame()
    return pl.concat([pl.from_arrow(store.read_table(p)) for p in paths]).sort("update")
