"""Tracker sinks: each update's metrics also go to TensorBoard, Weights & Biases or MLflow.

The store's own metrics (learner/metrics/*.parquet, histograms.zarr) stay the record; a
sink receives the same row under the same names (the `learner_metrics` columns), with the
update number as the step. Metrics that were not computed (NULL in the store, e.g.
`entropy` with the bonus off) are left out rather than written as 0.

One interface: `log(metrics, step)` and `close()`. Each tracker's package is imported
only when it is asked for; `check_trackers` fails early, with one line, when it is not
installed. Nothing waits on the network: wandb runs offline unless WANDB_API_KEY (or
WANDB_MODE) says otherwise, and MLflow writes a local file store unless
MLFLOW_TRACKING_URI names a server.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Protocol

from gagpo.schemas import layout
from gagpo.schemas.errors import GagpoError

TRACKERS = ("tensorboard", "wandb", "mlflow")
# The module each tracker needs, and the extra that installs it.
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: list[str]) -> None:
    """One line naming the missing package and how to install it, before any heavy work."""
    for name in names:
        if name not in _MODULES:
            raise GagpoError(f"unknown tracker {name!r}; accepted: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(_MODULES[name]) is None:
            raise GagpoError(
                f"--log-to {name} needs the {_MODULES[name]} package, which is not installed; "
                f"run: pip install 'gagpo[{name}]'"
            )


def scalars(row: dict) -> dict[str, float]:
    """The numeric, finite, computed entries of a metrics row."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if value is None or not math.isfinite(value):
            continue
        out[key] = float(value)
    return out


class TensorBoardSink:
    """Scalar events, one tag per metric, readable by TensorBoard's own event reader."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed learner still leaves every update it finished

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, log_dir: Path, run_name: str, config: dict) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "gagpo"),
            name=run_name,
            dir=str(log_dir),
            mode=mode,
            config=config,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, log_dir: Path, run_name: str, config: dict) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((log_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "gagpo"))
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:500] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def default_log_dir(store_root: str, is_local: bool) -> Path:
    """STORE/learner/tensorboard/ beside the metrics on a local store, else ./gagpo-runs/."""
    return Path(layout.tensorboard_dir(store_root)) if is_local else Path("gagpo-runs")


def open_sinks(
    names: list[str], log_dir: Path, *, run_name: str, config: dict | None = None
) -> list[Sink]:
    """The sinks asked for (in order); `config` goes to wandb/MLflow as the run's parameters."""
    check_trackers(names)
    log_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = []
    for name in dict.fromkeys(names):  # each once
        if name == "tensorboard":
            sinks.append(TensorBoardSink(log_dir))
        elif name == "wandb":
            sinks.append(WandbSink(log_dir, run_name, config or {}))
        elif name == "mlflow":
            sinks.append(MlflowSink(log_dir, run_name, config or {}))
    return sinks
