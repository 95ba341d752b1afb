"""RLVR benchmark: a fixed workload, per-phase times, and rollout throughput
beside bare vLLM `generate` of the same requests, measured in the same run.

    .venv/bin/python benchmarks/rlvr_bench.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet --steps 8 [--dp 2] [config overrides, e.g. parallel.tp=2]

Prints a table of mean phase times over the measured steps (the first step
is warm-up and excluded), the rollout phase's generated tokens/s against a
bare vLLM engine replaying the same requests (each step's prompts and
per-request sampling parameters, seeds included), and the weight-sync time
as a fraction of the step. The bare engine replays each step's requests right
after the step, with Ray's processes stopped and running (`PausedEngine`), and
all of them once more after Ray has shut down.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import statistics
import time

import psutil
import ray

import rlsys.tasks  # noqa: F401  (registers the `arith` reward)
from rlsys.actors.train_worker import TrainWorker
from rlsys.config.loader import load_config
from rlsys.config.schema import RLJobConfig
from rlsys.models.moe import num_experts
from rlsys.planner.shards import ModelShapes

PHASES = ("generate", "reward", "old_logprob", "reference", "update", "sync")


def bench_config(args, extra: list[str] = ()) -> RLJobConfig:
    overrides = [
        f"output_dir={args.out}", f"model.path={args.model}", f"data.train_files=[{args.data}]",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.engine_memory_gib=0.25",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", "train.micro_batch_tokens=16384",
        "train.save_every=0", "train.resume=false", f"parallel.dp_shard={args.dp}", "ray.include_dashboard=false",
        "tracking.backends=[jsonl]", f"algorithm.kl_coef={args.kl_coef}", "reward.terms=[{name: arith}]", *extra,
    ]
    return load_config(RLJobConfig, None, overrides)


def rlsys_steps(cfg: RLJobConfig, bare: PausedEngine | None = None, export: str | None = None
                ) -> tuple[list[dict], list, list[list[tuple]], list[dict[str, tuple[int, float]]]]:
    """Run the steps; returns their metrics, the first step's prompts, the arguments of each
    step's rollout calls (RolloutGroup.rollout), and with a `bare` engine its replay of each
    step's calls right after the step (`PausedEngine.replay_paired`). `export`: write the final
    policy there as a Hugging Face directory."""
    from rlsys.actors.cluster import ensure_ray
    from rlsys.stages.rl_trainer import RLVRTrainer

    ensure_ray(cfg.ray)
    trainer = RLVRTrainer(cfg)
    calls, rows, calls_by_step, replays = [], [], [], []
    rollout = trainer.rollout_group.rollout

    def recorded(*args, **kwargs):  # the bare engine replays the positional arguments (no weight version)
        calls.append(args)
        return rollout(*args, **kwargs)

    trainer.rollout_group.rollout = recorded
    try:
        for step in range(1, cfg.train.steps + 1):
            first_call, started = len(calls), time.perf_counter()
            rows.append(trainer.step(step))
            rows[-1]["bench/step_wall_s"] = time.perf_counter() - started  # the step's metrics included
            calls_by_step.append(calls[first_call:])
            if bare is not None:
                replays.append(bare.replay_paired(calls_by_step[-1], paused_first=step % 2 == 0))
        prompts = [(i, trainer.prompts[i].ids) for i in range(cfg.train.prompts_per_step)]
        if export:
            trainer.train_group.run_all(TrainWorker.export_hf, export)
    finally:
        trainer.shutdown()
    return rows, prompts, calls_by_step, replays


def bare_vllm_generate(cfg: RLJobConfig, prompts, repeats: int) -> tuple[float, list]:
    """The same prompts and sampling parameters through a plain in-process vLLM engine:
    the median time of `repeats` generations after a warm-up, and the last outputs."""
    from vllm import SamplingParams, TokensPrompt

    from rlsys.rollout.vllm_engine import create_llm

    llm = create_llm(cfg.model.path, cfg.rollout, cfg.seed)
    requests = [TokensPrompt(prompt_token_ids=ids) for _, ids in prompts]
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_tokens=cfg.rollout.max_new_tokens, logprobs=0, seed=cfg.seed,
                            detokenize=False)  # token ids only, as the rollout asks for them
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    del llm
    return statistics.median(times), outputs


def bare_requests(prompts: list[tuple], n: int, sampling, seed: int) -> tuple[list, list]:
    """A single-turn rollout call as one offline `generate`: n samples per prompt, the seeds the
    rollout worker gives them (its i-th sample the prompt's seed + i, as vLLM seeds n samples)."""
    from vllm import SamplingParams, TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=ids) for _, ids, _ in prompts]
    params = [SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                             max_tokens=min(sampling.max_new_tokens, sampling.max_response_tokens),
                             stop=list(sampling.stop) or None, detokenize=bool(sampling.stop), logprobs=0,
                             flat_logprobs=True, seed=seed * 1_000_003 + index)
              for index, _, _ in prompts]
    return requests, params


def _serve_bare_engine(cfg: RLJobConfig, conn) -> None:
    """The paused engine's process: replays the rollout calls it is sent, each from an empty
    prefix cache as after a sync; answers (generated tokens, seconds) for each batch of calls."""
    from rlsys.rollout.vllm_engine import create_llm

    llm = create_llm(cfg.model.path, cfg.rollout, cfg.seed)
    conn.send("ready")
    while (calls := conn.recv()) is not None:
        tokens, seconds = 0, 0.0
        for prompts, _, n, sampling, seed in calls:
            requests, params = bare_requests(prompts, n, sampling, seed)
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            seconds += time.perf_counter() - started
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        conn.send((tokens, seconds))


class PausedEngine:
    """A bare vLLM engine (`create_llm`, no Ray) in a process of its own, stopped with SIGSTOP
    except while it replays rlsys's rollout calls, so that it takes nothing from rlsys's steps.

    On these shared machines the speed of the same generation drifts by 15% over minutes, so a
    bare engine measured after rlsys (with Ray shut down) is compared with a different machine.
    `replay_paired` replays a step's calls right after the step, twice: with every other process
    this driver started stopped too (Ray's GCS, raylet, agents and rlsys's actors: the machine as
    without Ray, a second after rlsys's own rollout), and with them running, idle."""

    def __init__(self, cfg: RLJobConfig):
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve_bare_engine, args=(cfg, child_conn), daemon=True)
        self.process.start()
        child_conn.close()  # so that a dead engine process ends `recv` with EOFError
        try:
            self.conn.recv()
        except EOFError:
            raise SystemExit("the bare vLLM engine's process exited; its error is above") from None
        self._signal(signal.SIGSTOP, [self.process.pid])

    def replay(self, calls: list[tuple]) -> tuple[int, float]:
        """(generated tokens, seconds) of `calls`, with the rest of the machine as it is."""
        self._signal(signal.SIGCONT, [self.process.pid])
        try:
            self.conn.send(calls)
            return self.conn.recv()
        finally:
            self._signal(signal.SIGSTOP, [self.process.pid])

    def replay_paired(self, calls: list[tuple], paused_first: bool) -> dict[str, tuple[int, float]]:
        """`calls` replayed with this driver's other processes stopped ("paused") and running
        ("beside"), in the order `paused_first` says (alternate it to cancel an order effect)."""
        replays = {}
        for paused in (paused_first, not paused_first):
            others = [p.pid for p in psutil.Process().children(recursive=True) if p.pid != self.process.pid]
            if paused:
                self._signal(signal.SIGSTOP, others)
            try:
                replays["paused" if paused else "beside"] = self.replay(calls)
            finally:
                if paused:
                    self._signal(signal.SIGCONT, others)
        return replays

    def close(self) -> None:
        self._signal(signal.SIGCONT, [self.process.pid])
        self.conn.send(None)
        self.process.join(timeout=30)

    @staticmethod
    def _signal(signum: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--data", default="runs/arith/data/rl_train.parquet")
    parser.add_argument("--out", default="runs/bench/rlvr")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel training ranks (each gets cores / dp)")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*", help="rlsys config overrides (key=value)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is warm-up)")
    os.makedirs(args.out, exist_ok=True)
    cfg = bench_config(args, args.overrides)

    bare = PausedEngine(cfg)  # started before Ray, so its process is none of Ray's
    try:
        rows, _, calls, replays = rlsys_steps(cfg, bare)
        ray.shutdown()
        after_shutdown = bare.replay([call for step_calls in calls[1:] for call in step_calls])
    finally:
        bare.close()
    measured = rows[1:]
    mean = {k: statistics.mean(r[k] for r in measured) for k, v in measured[0].items() if isinstance(v, (int, float))}

    print(f"\nRLVR benchmark: {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
          f"{args.dp} FSDP2 ranks, {len(measured)} measured steps (first step excluded)")
    print(f"{'phase':<14}{'mean s':>10}{'share':>9}")
    for phase in PHASES:
        key = f"time/{phase}_s"
        if key in mean:
            print(f"{phase:<14}{mean[key]:>10.3f}{mean[key] / mean['time/step_s']:>9.1%}")
    print(f"{'step':<14}{mean['time/step_s']:>10.3f}")
    print_rollout_rates(measured, replays[1:], after_shutdown)
    print_sync(cfg, mean)
    print_throughput(cfg, mean)


def print_sync(cfg: RLJobConfig, mean: dict) -> None:
    """The weight sync's time and rate beside a copy of the same bytes on the device the shards are on."""
    import torch
    from sync import memcpy_time  # this directory's benchmarks/sync.py

    device = "cuda" if cfg.ray.gpus_per_worker and torch.cuda.is_available() else "cpu"
    floor = memcpy_time(int(mean["sync/mb"] * 2**20), device)
    how = "read in place" if mean.get("sync/in_place") else f"in {mean['sync/buckets']:.0f} buckets"
    print(f"weight sync: {mean['sync/time_s']:.3f} s = {mean['sync/time_s'] / mean['time/step_s']:.1%} of the step "
          f"({mean['sync/mb']:.1f} MB {how}: {mean['sync/mb'] / 1024 / mean['sync/time_s']:.2f} GiB/s; a {device} "
          f"copy of the same bytes {mean['sync/mb'] / 1024 / floor:.1f} GiB/s, {floor / mean['sync/time_s']:.2f}x)")


# Dense bf16 peak FLOP/s by device name, for MFU (the vendors' figures without sparsity)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def print_throughput(cfg: RLJobConfig, mean: dict) -> None:
    """VeRL's perf/throughput (tokens / (step time x GPUs)) and the update phase's MFU: 6 x the
    model's active parameters (the embedding lookup left out, the output layer and a token's top-k
    experts kept) per trained token."""
    import torch
    import transformers

    gpus = cfg.parallel.world_size if torch.cuda.is_available() else 0
    tokens = mean["throughput/tokens_per_s"] * mean["time/step_s"]
    print(f"tokens per step {tokens:,.0f}; perf/throughput {tokens / mean['time/step_s'] / max(gpus, 1):,.0f} "
          f"tokens/s per {'GPU' if gpus else 'process'}")
    if not gpus:
        return
    config = transformers.AutoConfig.from_pretrained(cfg.model.path)
    shapes = ModelShapes(config)
    embedding = config.vocab_size * config.hidden_size
    experts = num_experts(config)
    idle_experts = shapes.expert_total * (1 - config.num_experts_per_tok / experts) if experts else 0
    params = shapes.total - embedding * (0 if shapes.tied else 1) - idle_experts  # a tied output layer computes
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in re.split(r"[\s-]", name)), None)
    achieved = 6 * params * tokens / mean["time/update_s"] / gpus
    mfu = f"MFU {achieved / peak:.1%} of {peak / 1e12:.0f} TFLOP/s" if peak else "MFU: peak unknown"
    print(f"update: {params / 1e6:.0f}M parameters x 6 x tokens = {achieved / 1e12:.1f} TFLOP/s per GPU "
          f"on {name}; {mfu}")


def print_rollout_rates(rows: list[dict], replays: list[dict[str, tuple[int, float]]],
                        after_shutdown: tuple[int, float]) -> None:
    """rlsys's rollout tokens/s beside the bare engine's on the same requests, paired by step
    and after Ray shut down."""
    tokens = [r["throughput/generated_tokens_per_s"] * r["time/generate_s"] for r in rows]
    rlsys = sum(tokens) / sum(r["time/generate_s"] for r in rows)
    print("\nrollout, generated tokens/s on the same requests (same prompts, per-request seeds)")
    print(f"  rlsys (the step's generate phase, Ray actor)                {rlsys:>8,.0f} ({sum(tokens):,.0f} tokens)")
    print("  bare vLLM on each step's requests, right after the step:")
    for key, what in (("paused", "the driver's other processes stopped (as without Ray)"),
                      ("beside", "beside them, running idle")):
        bare = sum(r[key][0] for r in replays) / sum(r[key][1] for r in replays)
        per_step = [(t / r["time/generate_s"]) / (replay[key][0] / replay[key][1])
                    for t, r, replay in zip(tokens, rows, replays)]
        spread = ""
        if len(per_step) >= 4:
            low, median, high = statistics.quantiles(per_step, n=4)
            spread = f"; by step: median {median:.2f}, quartiles {low:.2f}-{high:.2f}"
        print(f"    {what:<58}{bare:>8,.0f}; rlsys / that: {rlsys / bare:.2f}{spread}")
    bare = after_shutdown[0] / after_shutdown[1]
    print(f"  bare vLLM on all of them again, after Ray shut down         {bare:>8,.0f}; rlsys / that: "
          f"{rlsys / bare:.2f}")


if __name__ == "__main__":
    main()
