"""One training step of a layout, measured on each rank: the bytes of parameters, gradients
and optimizer state it holds, and the peak memory of loading the model and of the step.
`benchmarks/memory.py` prints it for several layouts; the planner's `--check` sets it beside
its estimate.

Each layout runs in its own gloo (or nccl) process group of processes forked from a server that
imported this module once (no Ray: a rank's model does not need it), so that a layout costs its
measurement, not a fresh interpreter's imports per rank. Peak memory is the bytes tensors hold
above what they held before the model was built, as torch's allocator counts them:
max_memory_allocated on a GPU; on the CPU, the allocations and frees torch's profiler records (not
the resident set, which keeps what the allocator freed): the figure the planner estimates. On the
CPU the resident set's peaks come beside them (sampled every 5 ms): the host memory a run takes.

`StepShape.one_rank` measures a layout of any size at the model's full size: rank 0 alone, the
other ranks stood in by torch's fake process group (its collectives return without sending, so
what they would bring is garbage, but the rank's memory and compute are real: torchtitan estimates
memory so), the weights drawn at random (`model.random_init`: a directory with config.json is
enough). Pipeline and expert parallelism exchange sizes through collectives, which a fake group
cannot carry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from rlsys.algorithms.lm_loss import nll_loss
from rlsys.config.layout import ParallelConfig
from rlsys.config.model import LoraConfig, ModelConfig
from rlsys.config.training import OptimConfig
from rlsys.parallel.dims import ParallelDims
from rlsys.trainer.rank_model import RankModel, RankModelSpec
from rlsys.trainer.weights import local_tensor


@dataclass(frozen=True)
class StepShape:
    """The batch of the measured step, and where it runs."""

    rows: int = 4
    """Rows per data-parallel rank."""
    seq_len: int = 256
    steps: int = 1
    """Training steps; the last one is measured (from the second on, AdamW's state is held)."""
    micro_batch: int = 0
    """Rows per micro-batch (0: all the rank's rows)."""
    lora_rank: int = 0
    device: str = "cpu"
    """cpu: fp32; cuda: one GPU per rank, bf16 compute over fp32 masters (`parallel.mixed_precision: auto`)."""
    one_rank: bool = False
    """Rank 0 of the layout alone, in a fake process group, with random weights."""


def local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


class PeakSampler:
    """Resident-set high-water mark of this process over a window, sampled every 5 ms."""

    def __init__(self):
        self.peak, self._running = 0, False

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self.peak, self._running = self.rss(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self.rss())


class CpuAllocations:
    """The bytes tensors hold on the CPU over named windows, counted from every allocation and free
    that torch's profiler records from the moment this is entered: what CUDA's max_memory_allocated
    counts on a GPU, not the pages the process keeps mapped (its allocator keeps freed memory)."""

    def __enter__(self):
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        self.peaks: dict[str, int] = {}
        self.resident: dict[str, int] = {}
        """The process's resident-set high-water mark in each window, above its size on entering."""
        self._baseline = PeakSampler.rss()
        return self

    @contextlib.contextmanager
    def window(self, name: str):
        with record_function(f"{WINDOW}{name}"), PeakSampler() as sampler:
            yield
        self.resident[name] = sampler.peak - self._baseline

    def __exit__(self, *exc):
        self._profiler.__exit__(*exc)
        events = self._profiler.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        windows = sorted((e.start_ns(), e.end_ns(), e.name()[len(WINDOW):]) for e in events
                         if e.name().startswith(WINDOW))
        live, index = 0, 0
        for start, end, name in windows:  # in time order; the last window of a name counts
            while index < len(changes) and changes[index][0] < start:
                live += changes[index][1]
                index += 1
            peak = live
            while index < len(changes) and changes[index][0] <= end:
                live += changes[index][1]
                peak = max(peak, live)
                index += 1
            self.peaks[name] = peak


WINDOW = "rlsys.measure."


class CudaAllocations:
    """torch's allocated-bytes high-water mark on this process's GPU over named windows, above what
    was allocated when this was entered."""

    def __enter__(self):
        self.peaks: dict[str, int] = {}
        self.resident: dict[str, int] = {}
        """Empty on a GPU: the host's memory is not what the GPU's step holds."""
        self._baseline = torch.cuda.memory_allocated()
        return self

    @contextlib.contextmanager
    def window(self, name: str):
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.peaks[name] = torch.cuda.max_memory_allocated() - self._baseline

    def __exit__(self, *exc):
        pass


def run_rank(rank: int, layout: dict, model_dir: str, port: int, args: StepShape, results) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)  # torch's deprecation notes, once per rank
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    parallel = ParallelConfig(**layout)
    dims = ParallelDims.of(parallel)
    torch.set_num_threads(max(1, os.cpu_count() // (1 if args.one_rank else dims.world_size)))  # ranks here
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    if args.one_rank:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=dims.world_size)
    model = ModelConfig(path=model_dir, lora=LoraConfig(rank=args.lora_rank), random_init=args.one_rank)
    spec = RankModelSpec(model, OptimConfig(), dims, parallel, micro_batch_size=args.micro_batch or args.rows,
                         total_steps=10, param_dtype=torch.bfloat16 if on_gpu else None)  # mixed_precision=auto
    device = torch.device(args.device, rank if on_gpu else None)
    with (CudaAllocations() if on_gpu else CpuAllocations()) as memory:
        with memory.window("load"):
            rank_model = RankModel(spec, dims.build_mesh(args.device), device)
        grads, step_s = _steps(rank_model, dims, rank, model_dir, args, memory)
    params = local_bytes(p for _, p in rank_model.named_parameters())
    optim = local_bytes(t for optimizer in rank_model.optimizers for state in optimizer.state.values()
                        for t in state.values() if t.dim() > 0)
    results.put((rank, {"params": params, "grads": grads, "optim": optim, "load_peak": memory.peaks["load"],
                        "step_peak": memory.peaks["step"], "step_s": step_s,
                        "load_resident": memory.resident.get("load"), "step_resident": memory.resident.get("step")}))
    dist.destroy_process_group()


def _steps(model: RankModel, dims: ParallelDims, rank: int, model_dir: str, args: StepShape,
           memory) -> tuple[int, float]:
    """`args.steps` training steps on random tokens; the last one's gradient bytes and seconds."""
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    ids = torch.randint(0, min(vocab, 1000), (args.rows * dims.dp_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    shard = {k: v.tensor_split(dims.dp_size)[dims.coordinates(rank).dp_rank] for k, v in batch.items()}
    loss_fn = nll_loss(int(batch["loss_mask"][:, 1:].sum()))
    for _ in range(args.steps):  # the last step is measured: from the second on, AdamW's state is held
        started = time.perf_counter()
        with memory.window("step"):
            model.forward_backward(shard, loss_fn)
            grads = local_bytes(p.grad for _, p in model.named_parameters() if p.grad is not None)
            model.optimizer_step()
        step_s = time.perf_counter() - started
    return grads, step_s


def measure(layout: dict, model_dir: str, args: StepShape) -> list[dict]:
    """Per rank of `layout` (a `parallel:` section's keys), what it held in the last step:
    bytes of params, grads, optim; load_peak, step_peak (tensor bytes); on the CPU load_resident and
    step_resident (the process's resident set); step_s. With `args.one_rank`, rank 0's."""
    dims = ParallelDims.of(ParallelConfig(**layout))
    if args.one_rank and (dims.pp > 1 or dims.ep > 1):
        raise ValueError("one rank in a fake process group cannot run pp or ep: they exchange sizes")
    world = 1 if args.one_rank else dims.world_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # torch, transformers and the rank's model, imported once
    results = context.Queue()
    procs = [context.Process(target=run_rank, args=(r, layout, model_dir, port, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    by_rank = {}
    while len(by_rank) < world:
        try:
            rank, row = results.get(timeout=5)
            by_rank[rank] = row
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}; its error is above")
    for p in procs:
        p.join()
    return [by_rank[r] for r in range(world)]
