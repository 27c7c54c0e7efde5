"""`gagpo run`'s GPU layout (workflows/layout.py), planned on a CPU: the plan is data.

Plans for 1, 2 and 8 GPUs are checked process by process (devices, memory shares,
command lines, CUDA_VISIBLE_DEVICES); impossible layouts are refused in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gagpo.learner.config import LearnerConfig
from gagpo.schemas.config import GPU_MEMORY_SHARE_ENV, load_config
from gagpo.schemas.errors import GagpoError
from gagpo.workflows.layout import SEED_STRIDE
from gagpo.workflows.run import recipe_path
from tests.helpers.plans import plan_for

GAGPO = [sys.executable, "-m", "gagpo.workflows.cli"]


def test_one_gpu_shared_by_an_engine_and_the_learner():
    plan = plan_for("gpu-alfworld", gpus_visible=1)
    (actor,) = plan.actors
    assert actor.gpus == (0,) and actor.memory_share == pytest.approx(0.35)
    assert actor.env["CUDA_VISIBLE_DEVICES"] == "0" and actor.env[GPU_MEMORY_SHARE_ENV] == "0.35"
    assert actor.command[1:3] == ["-m", "gagpo.actors.cli"]
    assert actor.command[-4:-2] == ["--device", "cuda"]
    assert actor.command[-1] == "vllm.gpu_memory_utilization=0.35"
    learner = plan.learner
    assert learner.gpus == (0,) and learner.memory_share == pytest.approx(0.65)  # the rest
    assert learner.command[1:3] == ["-m", "gagpo.learner.cli"]  # one process, no torchrun
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert learner.env["OMP_NUM_THREADS"] == "32"  # 64 cores over 2 processes


def test_two_gpus_one_for_each_side():
    plan = plan_for(
        "gpu-alfworld",
        "run.actor_gpus=[0]",
        "run.learner_gpus=[1]",
        "actors.vllm.gpu_memory_utilization=0.9",
        gpus_visible=2,
    )
    assert [p.gpus for p in plan.processes] == [(0,), (1,)]
    assert plan.actors[0].memory_share == pytest.approx(0.9)
    assert plan.learner.memory_share == 1.0 and plan.learner.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_eight_gpus_four_engines_and_four_fsdp_ranks():
    plan = plan_for("gpu-alfworld-8")
    assert [a.gpus for a in plan.actors] == [(0,), (1,), (2,), (3,)]
    assert [a.env["CUDA_VISIBLE_DEVICES"] for a in plan.actors] == ["0", "1", "2", "3"]
    seeds = [int(a.command[a.command.index("--seed") + 1]) for a in plan.actors]
    assert seeds == [i * SEED_STRIDE for i in range(4)]  # no two actors share a task
    learner = plan.learner
    assert learner.gpus == (4, 5, 6, 7) and learner.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    cmd = learner.command
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:7] == ["-m", "gagpo.learner.cli"]
    assert all(p.env["OMP_NUM_THREADS"] == "8" for p in plan.processes)  # 64 cores, 8 processes
    learner_cfg = load_config(
        LearnerConfig, recipe_path("gpu-alfworld-8"), section="learner", overrides={"store": "S"}
    )
    assert learner_cfg.parallel == "fsdp"


def test_several_actors_share_a_gpu_with_their_memory_shares():
    plan = plan_for(
        "gpu-alfworld",
        "run.actor_gpus=[0,0,1,1]",
        "run.learner_gpus=[2]",
        "run.actor_gpu_memory=0.4",
        gpus_visible=3,
    )
    assert [a.gpus for a in plan.actors] == [(0,), (0,), (1,), (1,)]
    assert {a.env[GPU_MEMORY_SHARE_ENV] for a in plan.actors} == {"0.4"}


def test_a_cpu_recipe_plans_cpu_processes():
    plan = plan_for("tiny", gpus_visible=0, cpus=2)
    assert [p.label for p in plan.processes] == ["actor 0", "learner"]
    assert all(not p.gpus and "CUDA_VISIBLE_DEVICES" not in p.env for p in plan.processes)


@pytest.mark.parametrize(
    ("sets", "visible", "message"),
    [
        (
            ("run.actor_gpus=[0,0]", "run.actor_gpu_memory=0.5"),
            1,
            "GPU 0: 2 actor(s) × 0.5 of its memory leave the learner none",
        ),
        (
            ("run.actor_gpus=[0,0]", "run.actor_gpu_memory=0.4", "run.learner_gpu_memory=0.3"),
            1,
            "GPU 0 is over-committed: 2 actor(s) × 0.4 + the learner's 0.3 = 1.1",
        ),
        (
            ("run.actor_gpus=[0]", "run.learner_gpus=[1]"),
            1,
            "run.learner_gpus names GPU 1 but 1 GPU(s) are visible; accepted: ids 0..0",
        ),
        (("run.actor_gpus=[0]",), 0, "run.actor_gpus names GPU 0 but no GPU is visible"),
        (("run.learner_gpus=[1,1]",), 8, "lists a GPU twice"),
        (
            ("run.actor_gpus=[0,1]", "run.actors=3"),
            8,
            "run.actors = 3 but run.actor_gpus lists 2 GPUs",
        ),
        (("run.learner_gpus=[1,2]", "learner.device='cpu'"), 8, "learner.device = 'cpu'"),
    ],
    ids=[
        "no-room-for-learner",
        "over-committed",
        "beyond-visible",
        "no-gpu",
        "twice",
        "actors-mismatch",
        "cpu-learner",
    ],
)
def test_impossible_layouts_are_refused_in_one_line(sets, visible, message):
    with pytest.raises(GagpoError, match=re.escape(message)):
        plan_for("gpu-alfworld", *sets, gpus_visible=visible)


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path):
    store = tmp_path / "store"
    out = subprocess.run(
        [*GAGPO, "run", "--recipe", "gpu-alfworld-8", "--store", str(store), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "plan: 4 actor(s) and the learner" in out.stdout
    assert "learner   on GPU 4,5,6,7" in out.stdout
    assert out.stdout.count("CUDA_VISIBLE_DEVICES=") == 5
    assert "torch.distributed.run --standalone --nproc-per-node=4" in out.stdout
    assert not store.exists()  # nothing started, nothing written
    bad = subprocess.run(
        [
            *GAGPO,
            "run",
            "--recipe",
            "gpu-alfworld",
            "--store",
            str(store),
            "--dry-run",
            "--set",
            "run.actor_gpus=[0,0]",
            "--set",
            "run.actor_gpu_memory=0.6",
            "--set",
            "run.learner_gpu_memory=0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "GPU 0 is over-committed" in bad.stderr
    assert "Traceback" not in bad.stderr
