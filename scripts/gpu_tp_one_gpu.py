"""gpu_check's `tp2_one_gpu`: a rollout engine of tensor-parallel size 2 colocated with two training
ranks' bundles, as rlsys places one on a node of GPUs, reproduced on the one GPU a machine has: the
ranks' placement group is two bundles of {GPU: 0.5} on it, and the engine's actor holds no GPU while
vLLM's Ray executor puts one worker in each bundle (`VLLM_RAY_BUNDLE_INDICES`,
`VLLM_RAY_PER_WORKER_GPUS`; rlsys.actors.engine_placement). Before that placement, vLLM's workers
asked the group for GPUs that its bundles already held and waited without end.

What it shows: both of vLLM's workers are scheduled (their actors have processes), each in its own
bundle, within `--schedule-s` (exit 1 if they are still waiting: the hang). What follows on one GPU
is printed but not required: NCCL refuses two ranks of one group on one device, which a node of GPUs
never asks of it.

    python scripts/gpu_tp_one_gpu.py --model DIR
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import ray
from ray.util.state import list_actors

from rlsys.actors.cluster import place_ranks
from rlsys.actors.rollout_group import RolloutGroup
from rlsys.config.loader import first_line
from rlsys.config.rollout import RolloutConfig

RANKS = 2
GPU_SHARE = 0.5
"""Each training rank's bundle: half of the one GPU, as two ranks of a node hold a GPU each."""


def start_engine(model: str, outcome: dict) -> None:
    try:
        ranks = place_ranks(RANKS, {"CPU": 1, "GPU": GPU_SHARE})
        cfg = RolloutConfig(placement="colocated", num_engines=1, tensor_parallel_size=RANKS, n=1, max_new_tokens=8,
                            gpu_memory_utilization=0.2, free_memory_in_update=False)
        group = RolloutGroup(model, cfg, seed=0, train_placement=ranks, train_cpus=RANKS, gpu_share=GPU_SHARE)
        outcome["started"] = "the engine started and took its two workers"
        group.shutdown()
    except Exception as error:  # reported below: on one GPU the engine's end is not what is checked
        outcome["error"] = first_line(error)


WORKER_CLASSES = ("RayWorkerProc", "RayWorkerWrapper")
"""vLLM's Ray executor's worker actor: RayWorkerProc from vLLM 0.26 (ray_executor_v2), RayWorkerWrapper before."""


def scheduled_workers() -> list[dict]:
    """vLLM's worker actors that reached a process: alive, or dead after they started (on one GPU, NCCL
    refuses the two ranks once they run)."""
    actors = [actor for name in WORKER_CLASSES
              for actor in list_actors(filters=[("class_name", "=", name)], detail=True)]
    return [actor for actor in actors if actor.get("pid")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--schedule-s", type=float, default=180.0)
    parser.add_argument("--end-s", type=float, default=300.0)
    args = parser.parse_args()
    ray.init()
    outcome: dict = {}
    began = time.monotonic()
    threading.Thread(target=start_engine, args=(args.model, outcome), daemon=True).start()
    placed: list[dict] = []
    while time.monotonic() - began < args.schedule_s:
        ended = bool(outcome)  # read first: once the engine ended, what reached a process has
        placed = scheduled_workers()
        if len(placed) >= RANKS or ended:
            break
        time.sleep(1)
    scheduled = len(placed) >= RANKS
    print(f"[tp2_one_gpu] vLLM's {RANKS} workers {'scheduled' if scheduled else 'NOT scheduled'} after "
          f"{time.monotonic() - began:.0f} s: {sorted(actor['state'] for actor in placed) or 'none yet'}")
    while not outcome and time.monotonic() - began < args.end_s:
        time.sleep(1)
    print(f"[tp2_one_gpu] then: {outcome.get('started') or outcome.get('error') or 'still starting'}")
    return 0 if scheduled or "started" in outcome else 1


if __name__ == "__main__":
    sys.exit(main())
