"""Warm start from demonstrations: expert shards → supervised learner → a cached base policy.

    gagpo warmstart --env sokoban --policy tiny      → $GAGPO_CACHE/warmstart/<key>/policy

Three ordinary steps, through the same store and learner as RL (docs/warmstart.md):
  1. demonstrations: the actor loop with the environment's expert playing
     (`gagpo-actors --expert --expert-noise p`), prompts encoded by the policy;
  2. supervised fine-tuning: `gagpo-learner --mode sft --replay` over those shards, one
     group per demonstration, each trained on once; it publishes ordinary versions;
  3. the last version is copied out as a Hugging Face folder (`policy/`), usable as
     `--policy <folder>` anywhere, with `warmstart.json` beside it (settings, NLL before and
     after, and the success and valid-reply rates of the result when `eval_groups` > 0).

The cache key hashes every setting and the base policy's identity; the folder is built
under a temporary name and renamed into place, so a run sees a complete warm start or
none, and later runs (`gagpo run` with a recipe's [warmstart] table) reuse it.

Shipped warm starts: the demo recipe's result (the `tiny` policy, under 1 MiB) ships with
the package in workflows/recipes/warmstarts/demo/ (policy/, warmstart.json, MANIFEST of
sha256 sums), so a first `make demo` skips ten minutes of demonstrations and SFT on two
cores. A warm start whose cache key equals a shipped one's is copied from there into the
cache (its files checked against MANIFEST); any other key is built as above. After a change
that moves the demo's key (its [warmstart] table, the tiny preset, sokoban's `revision`,
WARMSTART_FORMAT), rebuild the shipped folder with

    python -m gagpo.workflows.ship_warmstart demo

(tests/test_demo_story.py fails until the shipped key matches the code and the recipe).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from gagpo.schemas import layout
from gagpo.schemas.cache import cache_root
from gagpo.schemas.config import Config
from gagpo.schemas.policy import PolicySpec

WARMSTART_FORMAT = 1  # bump when what a warm start produces changes, so old caches are not reused
POLICY_DIR, INFO_FILE, MANIFEST = "policy", "warmstart.json", "MANIFEST"
SHIPPED = "warmstarts"  # folder of gagpo.workflows.recipes: one shipped warm start per recipe


class WarmstartConfig(Config):
    """A warm start: demonstrations on `env`, then supervised fine-tuning of `policy`."""

    env: str = "sokoban"
    """Environment whose expert plays the demonstrations."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options of the environment (as in [actors.env_options])."""
    policy: str = "tiny"
    """Base policy to fine-tune: a preset name or a Hugging Face model folder."""
    max_turns: int = Field(20, ge=1, le=10_000)
    """Turn limit per demonstration; keep it equal to the RL run's (prompts must match)."""
    history_window: int = Field(2, ge=0, le=1000)
    """Earlier turns in each prompt; keep it equal to the RL run's (prompts must match)."""
    max_prompt_tokens: int = Field(1536, ge=16, le=131072)
    """Prompt budget of the policy, as the RL actors use it."""
    demos: int = Field(512, ge=1, le=10_000_000)
    """Demonstration groups (tasks) to record; each is trained on once."""
    group_size: int = Field(1, ge=1, le=1024)
    """Demonstrations per task (more than 1 only differ with noise)."""
    noise: float = Field(0.1, ge=0.0, le=1.0)
    """Probability that a demonstration turn plays a random admissible command (the expert
    then replans): demonstrations then also show how to recover."""
    seed: int = Field(10**9, ge=0, le=2**62)
    """First task seed of the demonstrations (far from RL's default seeds: no task overlap)."""
    batch_groups: int = Field(8, ge=1, le=1_000_000)
    """Demonstration groups per supervised update."""
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    """Peak learning rate of the supervised updates."""
    warmup_steps: int = Field(5, ge=0, le=10**9)
    """Linear learning-rate warm-up, in updates."""
    eval_groups: int = Field(0, ge=0, le=100_000)
    """Groups of 4 rollouts the result plays after training, to report its success rate
    (recorded in warmstart.json; 0 skips it)."""

    @property
    def updates(self) -> int:
        return math.ceil(self.demos / self.batch_groups)


def warmstart_root() -> Path:
    """$GAGPO_CACHE/warmstart: one folder per cache key."""
    return cache_root() / "warmstart"


def policy_identity(policy: str) -> str:
    """What the base policy is: a preset's cache folder name (a content hash), or a folder's
    absolute path with its weight files' sizes and modification times."""
    from gagpo.actors.policies.presets import resolve_model

    folder = resolve_model(policy)
    if PolicySpec.parse(policy).kind == "preset":
        return f"preset:{folder.name}"
    files = [*sorted(folder.glob("*.safetensors")), folder / "config.json"]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return f"folder:{folder.resolve()}:{stats}"


def cache_key(cfg: WarmstartConfig) -> str:
    what = {
        "format": WARMSTART_FORMAT,
        "config": cfg.model_dump(mode="json", exclude={"eval_groups"}),
        "policy": policy_identity(cfg.policy),
    }
    if revision := env_revision(cfg.env):  # new observation text: old warm starts not reused
        what["env_revision"] = revision
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def env_revision(env: str) -> int:
    """A built-in environment's `revision` (0 for others): bumped when its observations or
    instructions change, so that warm starts trained on the old text are rebuilt."""
    from gagpo.envs import ENVIRONMENTS

    return getattr(ENVIRONMENTS.get(env), "revision", 0)


def warmstart(cfg: WarmstartConfig, *, echo=print) -> Path:
    """The warm-started policy folder for `cfg`: from the cache, or built (atomically) now."""
    from gagpo.storage.files import build_once

    key = cache_key(cfg)
    final = warmstart_root() / key
    if (final / INFO_FILE).is_file():
        echo(f"warm start: cached at {final}")
        return final / POLICY_DIR
    if (shipped := shipped_warmstart(key)) is not None:
        build_once(final, lambda tmp: _copy_shipped(shipped, tmp))
        echo(f"warm start: shipped with the package ({shipped.name}, key {key}), now at {final}")
        return final / POLICY_DIR
    echo(
        f"warm start: {cfg.demos} demonstration group(s) on {cfg.env} (noise {cfg.noise}), "
        f"then {cfg.updates} supervised update(s) of {cfg.policy!r}"
    )
    build_once(final, lambda tmp: _build(cfg, tmp, echo))
    echo(f"warm start: ready at {final}")
    return final / POLICY_DIR


def shipped_root() -> Path:
    """workflows/recipes/warmstarts/ of the installed package."""
    from importlib import resources

    return Path(str(resources.files("gagpo.workflows.recipes") / SHIPPED))


def shipped_warmstart(key: str) -> Path | None:
    """The shipped warm-start folder whose warmstart.json has cache key `key`, or None."""
    root = shipped_root()
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        info = folder / INFO_FILE
        if info.is_file() and json.loads(info.read_text()).get("key") == key:
            return folder
    return None


def manifest(folder: Path) -> dict[str, str]:
    """sha256 of every file of a warm-start folder but MANIFEST, by relative path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


def _copy_shipped(shipped: Path, folder: Path) -> None:
    from gagpo.schemas.errors import GagpoError

    recorded = json.loads((shipped / MANIFEST).read_text())
    if manifest(shipped) != recorded:
        raise GagpoError(
            f"shipped warm start {shipped} does not match its MANIFEST; rebuild it: "
            f"python -m gagpo.workflows.ship_warmstart {shipped.name}"
        )
    shutil.copytree(shipped / POLICY_DIR, folder / POLICY_DIR)
    shutil.copy2(shipped / INFO_FILE, folder / INFO_FILE)  # last: marks a complete warm start


def _build(cfg: WarmstartConfig, folder: Path, echo) -> None:
    from gagpo.storage.store import Store

    store = Store(str(folder / "store"))  # opened once: the demonstrations, SFT, the result
    demos = record_demonstrations(cfg, store.url)
    echo(f"warm start: {demos.steps} demonstration steps, expert success {demos.success_rate:.1%}")
    summary, nll = supervised(cfg, store, echo=echo)
    echo(f"warm start: NLL per action token {nll[0]:.3f} → {nll[-1]:.3f} in {len(nll)} updates")
    src = Path(store.policies.dir(summary.version))
    shutil.copytree(src, folder / POLICY_DIR, ignore=shutil.ignore_patterns(".*"))
    shutil.rmtree(layout.checkpoints_dir(store.root), ignore_errors=True)
    info = {
        "key": cache_key(cfg),  # folder is the temporary build folder here
        "config": cfg.model_dump(mode="json"),
        "demo_steps": demos.steps,
        "demo_success_rate": demos.success_rate,
        "sft_updates": len(nll),
        "nll_first": nll[0],
        "nll_last": nll[-1],
    }
    if cfg.eval_groups:
        info["eval"] = evaluate(
            str(folder / POLICY_DIR),
            cfg,
            groups=cfg.eval_groups,
            store=str(folder / "eval-store"),
        )
        echo(
            f"warm start: the result solves {info['eval']['success_rate']:.1%} of its "
            f"rollouts ({info['eval']['valid_rate']:.1%} valid replies)"
        )
    # Written last: its presence marks a complete warm start (see `warmstart`).
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def record_demonstrations(cfg: WarmstartConfig, store: str):
    """`cfg.demos` expert (noisy-expert) groups as ordinary shards in `store`, prompted as
    an RL actor of `cfg.policy` would be; returns the actor's summary."""
    from gagpo.actors.actor import run_actor
    from gagpo.actors.config import ActorConfig, SamplingConfig

    return run_actor(
        ActorConfig(
            store=store,
            env=cfg.env,
            env_options=cfg.env_options,
            policy=cfg.policy,
            groups=cfg.demos,
            group_size=cfg.group_size,
            max_turns=cfg.max_turns,
            history_window=cfg.history_window,
            seed=cfg.seed,
            groups_per_shard=16,
            expert=True,
            expert_noise=cfg.noise,
            run_id="demonstrations",  # reproducible noise
            sampling=SamplingConfig(max_prompt_tokens=cfg.max_prompt_tokens),
        )
    )


def supervised(cfg: WarmstartConfig, store, replay: str | None = None, echo=None):
    """SFT of `cfg.policy` on the demonstrations in `replay` (default: `store`, a Store or
    its URL), each group once, versions published in `store`; returns the learner's summary
    and NLL per update."""
    from gagpo.learner.config import LearnerConfig
    from gagpo.learner.metrics import read_metrics
    from gagpo.learner.train import train
    from gagpo.storage.store import Store

    store = store if isinstance(store, Store) else Store(store)
    # Replay: no waiting for actors, no staleness drop, each group once.
    sft = LearnerConfig(
        store=store.url,
        replay=replay or store.url,
        policy=cfg.policy,
        mode="sft",
        updates=cfg.updates,
        batch_groups=cfg.batch_groups,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        write_advantages=False,
        keep_versions=1,
    )
    progress = _every_nth_update(echo, max(1, cfg.updates // 8)) if echo else None
    summary = train(sft, echo=progress)
    return summary, read_metrics(store)["loss"].to_list()


def _every_nth_update(echo, n: int):
    """The learner's per-update lines, every `n`-th, cut to update, ETA and loss."""

    def line(text: str) -> None:
        number = text.split(" ", 2)[1].split("/")[0] if text.startswith("update ") else ""
        if number.isdigit() and int(number) % n == 0:
            echo("warm start: SFT " + "  ".join(text.split("  ")[:3]))

    return line


def evaluate(
    policy: str, cfg: WarmstartConfig, *, groups: int, store: str | None = None, seed: int = 0
) -> dict[str, float]:
    """Success and valid-reply rates (and mean return) of `policy` on `cfg.env`: `groups`
    groups of 4 rollouts from task `seed` on, sampled at temperature 1 as RL actors sample."""
    from gagpo.actors.config import ActorConfig, SamplingConfig
    from gagpo.workflows.evaluate import play

    actors = ActorConfig(
        store="-",
        env=cfg.env,
        env_options=cfg.env_options,
        policy=policy,
        groups=groups,
        group_size=4,
        max_turns=cfg.max_turns,
        history_window=cfg.history_window,
        seed=seed,
        sampling=SamplingConfig(max_prompt_tokens=cfg.max_prompt_tokens),
    )
    return play(actors, store)  # store "-" above: play() sets the real one
