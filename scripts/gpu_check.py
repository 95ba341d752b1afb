"""The trainer on a GPU, without Ray or vLLM: loss, gradients and log-probs of
`RankModel` on CUDA (nccl, fp32 and bf16 mixed precision) against one plain Hugging Face
process on the same batch; the in-place weight sync, whose reader (a colocated rollout
engine) maps a rank's shards through CUDA IPC; then the trainer's forward/backward throughput
beside that process's on a Qwen2.5-0.5B-shaped model. Run by `scripts/gpu_check.sh`.

The lent GPU machines hold torch and transformers but neither Ray nor vLLM, and reach no
package registry, so this is the part of the GPU path that can run there. On a machine
without CUDA it runs the same checks on gloo, which is how it is kept working.

    python scripts/gpu_check.py [--ranks N] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
from rlsys.algorithms.lm_loss import logprobs_of_labels, nll_loss, token_logprobs
from rlsys.config.layout import ParallelConfig
from rlsys.config.model import ModelConfig
from rlsys.config.rl import AlgorithmConfig
from rlsys.config.training import OptimConfig
from rlsys.models.tiny import TinyModelSpec, write_tiny_model
from rlsys.parallel.dims import ParallelDims
from rlsys.sync.shards import shared_pieces
from rlsys.trainer.rank_model import RankModel, RankModelSpec
from rlsys.trainer.weights import full_tensor

ALGO = AlgorithmConfig(kl_coef=0.1, clip_ratio_low=0.1, clip_ratio_high=0.1)
TOLERANCE = {"float32": 1e-4, "bf16": 3e-2}
"""Relative error allowed against the fp32 reference: fp32 on GPU sums in another order
than one process does (1e-5 on CPU); bf16 rounds every matmul input to 8 bits of mantissa."""
TINY = TinyModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
QWEN25_05B = TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=1024)


def make_batch(vocab: int, rows: int, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token rows of uneven lengths (so micro-batches pack), the RL fields beside the SFT ones."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (rows,), generator=generator)
    attention = (torch.arange(width) < lengths[:, None]).long()
    input_ids = torch.randint(3, vocab, (rows, width), generator=generator) * attention
    loss_mask = attention.float()
    loss_mask[:, :2] = 0
    noise = lambda: 0.05 * torch.randn(rows, width, generator=generator)  # noqa: E731
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
            "advantages": torch.randn(rows, 1, generator=generator) * loss_mask,
            "old_logprobs": noise() - 4, "ref_logprobs": noise() - 4}


def loss_fns(batch) -> dict:
    targets = int(batch["loss_mask"][:, 1:].sum())
    counts = {"tokens": targets, "sequences": len(batch["input_ids"])}
    return {"sft": nll_loss(targets), "rl": actor_loss(counts, ALGO, ActorInputs(old_logprobs=True, ref_logprobs=True))}


def reference(model_dir: str, batch, device: torch.device) -> dict:
    """One process, fp32, no engine: loss and gradients of each loss, and the log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    on_device = {k: v.to(device) for k, v in batch.items()}
    result = {}
    for name, loss_fn in loss_fns(batch).items():
        model.zero_grad()
        out = loss_fn(model(input_ids=on_device["input_ids"], attention_mask=on_device["attention_mask"]).logits,
                      on_device)
        out.loss.backward()
        result[name] = (out.loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    with torch.no_grad():
        logits = model(input_ids=on_device["input_ids"], attention_mask=on_device["attention_mask"]).logits
        result["logprobs"] = torch.nn.functional.pad(logprobs_of_labels(logits, on_device["input_ids"]), (1, 0)).cpu()
    return result


def start_rank(rank: int, world: int, port: int) -> torch.device:
    """Joins the process group (nccl for CUDA tensors, gloo beside it) and returns the rank's device."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    return device


def build_engine(model_dir: str, device: torch.device, layout: dict, precision: str, micro_batch_size: int,
                 optim: OptimConfig = OptimConfig()) -> tuple[RankModel, ParallelDims]:
    parallel = ParallelConfig(**layout)
    dims = ParallelDims.of(parallel)
    spec = RankModelSpec(ModelConfig(path=model_dir), optim, dims, parallel, micro_batch_size=micro_batch_size,
                         total_steps=1, param_dtype=torch.bfloat16 if precision == "bf16" else None)
    return RankModel(spec, dims.build_mesh(device.type), device), dims


def engine_rank(rank: int, world: int, port: int, layout: dict, precision: str, model_dir: str, batch,
                out_path: str) -> None:
    """One rank: the engine in `layout`; rank 0 saves loss, full gradients and log-probs."""
    device = start_rank(rank, world, port)
    try:
        engine, dims = build_engine(model_dir, device, layout, precision, micro_batch_size=4)
        where = dims.coordinates(rank)
        shard = {k: v[where.dp_rank::dims.dp_size] for k, v in batch.items()}
        result = {}
        for name, loss_fn in loss_fns(batch).items():
            metrics, _ = engine.forward_backward(shard, loss_fn)
            grads = {n: full_tensor(p.grad).float().cpu() for n, p in engine.named_parameters()}
            result[name] = (metrics.get("loss"), grads)
            engine.zero_grad()
        _, rows = engine.forward_backward(shard, token_logprobs(), forward_only=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, (where.dp_rank, where.collected, rows["logprobs"]))
        logprobs = torch.empty_like(batch["input_ids"], dtype=torch.float32)
        for dp_rank, collected, part in gathered:
            if collected:
                logprobs[dp_rank::dims.dp_size] = part
        result["logprobs"] = logprobs
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(world: int, layout: dict, precision: str, model_dir: str, batch, workdir: str) -> dict:
    out_path = os.path.join(workdir, "engine.pt")
    mp.spawn(engine_rank, args=(world, free_port(), layout, precision, model_dir, batch, out_path), nprocs=world)
    return torch.load(out_path)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def compare(got: dict, expected: dict, batch) -> dict[str, float]:
    """The worst relative error of each quantity, over every parameter's gradient."""
    errors = {}
    for name in ("sft", "rl"):
        (got_loss, got_grads), (ref_loss, ref_grads) = got[name], expected[name]
        if name == "sft":
            errors[f"{name} loss"] = abs(got_loss - ref_loss) / abs(ref_loss)
        errors[f"{name} grads"] = max(relative_error(got_grads[n], ref_grads[n]) for n in ref_grads)
    mask = batch["attention_mask"].bool()
    errors["logprobs"] = relative_error(got["logprobs"][mask], expected["logprobs"][mask])
    return errors


def layouts(world: int) -> dict[str, dict]:
    if world == 1:
        return {"1 rank": {"dp_shard": 1}, "1 rank offload": {"dp_shard": 1, "offload": True}}
    return {f"dp_shard={world}": {"dp_shard": world}, f"dp_shard={world} offload": {"dp_shard": world, "offload": True},
            f"tp={world} sp lp": {"dp_shard": 1, "tp": world, "sequence_parallel": True, "loss_parallel": True}}


def check_parity(world: int, workdir: str, model_dir: str) -> bool:
    batch = make_batch(vocab=TINY.vocab_size, rows=8, width=24)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    expected = reference(model_dir, batch, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    ok = True
    for name, layout in layouts(world).items():
        for precision in ("float32", "bf16"):
            errors = compare(run_engine(world, layout, precision, model_dir, batch, workdir), expected, batch)
            passed = max(errors.values()) < TOLERANCE[precision]
            ok &= passed
            shown = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
            print(f"[parity] {name:<18} {backend} {precision:<8} {'ok  ' if passed else 'FAIL'} {shown}", flush=True)
    return ok


def throughput(workdir: str, model_dir: str, shapes: list[tuple[int, int]], steps: int) -> None:
    """Tokens/s of a forward/backward with the NLL loss on one device: plain HF (bf16 autocast)
    beside the engine on one rank with bf16 mixed precision, same batch, one sitting."""
    for rows, width in shapes:
        batch = make_batch(vocab=QWEN25_05B.vocab_size, rows=rows, width=width)
        tokens = int(batch["attention_mask"].sum())
        hf = hf_step_s(model_dir, batch, steps)
        torch.cuda.empty_cache()
        out_path = os.path.join(workdir, "throughput.txt")
        mp.spawn(engine_throughput, args=(free_port(), model_dir, batch, steps, out_path), nprocs=1)
        with open(out_path) as f:
            engine = float(f.read())
        print(f"[throughput] 0.5B-shaped, {rows} x {width} tokens ({tokens} real): HF bf16 autocast "
              f"{tokens / hf:,.0f} tok/s ({hf:.3f} s/step); engine, 1 rank, bf16 mixed precision "
              f"{tokens / engine:,.0f} tok/s ({engine:.3f} s/step): {engine / hf:.2f}x HF's time", flush=True)


def hf_step_s(model_dir: str, batch, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    on_device = {k: v.to("cuda") for k, v in batch.items()}
    loss_fn = nll_loss(int(batch["loss_mask"][:, 1:].sum()))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=on_device["input_ids"], attention_mask=on_device["attention_mask"]).logits
        loss_fn(logits, on_device).loss.backward()
        model.zero_grad(set_to_none=True)

    return timed(step, steps)


def engine_throughput(rank: int, port: int, model_dir: str, batch, steps: int, out_path: str) -> None:
    device = start_rank(rank, 1, port)
    try:
        engine, _ = build_engine(model_dir, device, {"dp_shard": 1}, "bf16", micro_batch_size=len(batch["input_ids"]))
        loss_fn = nll_loss(int(batch["loss_mask"][:, 1:].sum()))

        def step():
            engine.forward_backward(batch, loss_fn)
            engine.zero_grad()

        with open(out_path, "w") as f:
            f.write(str(timed(step, steps)))
    finally:
        dist.destroy_process_group()


def check_in_place_sync(model_dir: str, batch) -> bool:
    """The in-place weight sync: another process (as a colocated rollout engine) reads an engine
    rank's shards (through CUDA IPC on a GPU, shared memory on CPU), and finds the rank's
    parameters before and after an optimizer step. On a GPU, then the time to copy them all into
    bf16 weights (what a vLLM engine holds), beside the same copies from the process's own tensors."""
    context = mp.get_context("spawn")
    conn, rank_conn = context.Pipe()
    rank = context.Process(target=sharing_rank, args=(rank_conn, free_port(), model_dir, batch))
    rank.start()
    rank_conn.close()  # a rank that dies ends the reads below
    try:
        pieces = shared_pieces([conn.recv()])
        mapped = {name: tensor for name, [(_, tensor)] in pieces.items()}
        before = conn.recv()
        ok = all(torch.equal(mapped[name].cpu(), value) for name, value in before.items())
        conn.send("step")
        after = conn.recv()
        ok &= all(torch.equal(mapped[name].cpu(), value) for name, value in after.items())
        ok &= any(not torch.equal(after[name], before[name]) for name in before)
        how = "CUDA IPC" if torch.cuda.is_available() else "shared memory"
        print(f"[in-place sync] {how}, {len(mapped)} tensors: {'ok  ' if ok else 'FAIL'} the reader sees the "
              "rank's weights before and after a step", flush=True)
        if torch.cuda.is_available():
            ipc_s, local_s = copy_times(mapped)
            gb = sum(t.numel() * t.element_size() for t in mapped.values()) / 1e9
            print(f"[in-place sync] copying {gb:.2f} GB of shards into bf16 weights: through CUDA IPC "
                  f"{ipc_s * 1e3:.2f} ms, from the process's own tensors {local_s * 1e3:.2f} ms: "
                  f"{ipc_s / local_s:.2f}x", flush=True)
        del pieces, mapped
        conn.send("done")
        rank.join(timeout=60)
        return ok
    finally:
        if rank.is_alive():
            rank.kill()


def sharing_rank(conn, port: int, model_dir: str, batch) -> None:
    """One engine rank (bf16 mixed precision) that shares its shards, sends its full parameters,
    takes an optimizer step when asked and sends them again."""
    device = start_rank(0, 1, port)
    try:
        engine, _ = build_engine(model_dir, device, {"dp_shard": 1}, "bf16", micro_batch_size=len(batch["input_ids"]),
                                 optim=OptimConfig(lr=1e-3))
        conn.send(engine.weights.share_shards(list(engine.weights.parameter_nbytes())))
        conn.send(full_parameters(engine))
        conn.recv()
        engine.forward_backward(batch, nll_loss(int(batch["loss_mask"][:, 1:].sum())))
        engine.optimizer_step()
        conn.send(full_parameters(engine))
        conn.recv()
    finally:
        dist.destroy_process_group()


def full_parameters(engine: RankModel) -> dict[str, torch.Tensor]:
    """Copies (a CPU tensor sent through a pipe would share the parameter's own memory)."""
    return {name: full_tensor(p).detach().to("cpu", copy=True) for name, p in engine.named_parameters()}


def copy_times(sources: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Seconds to copy every tensor of `sources` into a bf16 tensor of its shape, and the same
    from clones of them in this process (the peer: no IPC)."""
    weights = {name: torch.empty(t.shape, dtype=torch.bfloat16, device="cuda") for name, t in sources.items()}
    local = {name: t.clone() for name, t in sources.items()}

    def copy_from(tensors):
        return lambda: [weights[name].copy_(t) for name, t in tensors.items()]

    return timed(copy_from(sources), 10), timed(copy_from(local), 10)


def timed(step, steps: int) -> float:
    """Median seconds of `steps` calls after two warm-ups."""
    step(), step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None,
                        help="engine ranks (default: every GPU; 2 gloo ranks without CUDA)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"[gpu] {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
              f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    else:
        print("[gpu] no CUDA device: the same checks on CPU with gloo", flush=True)
    world = args.ranks or (torch.cuda.device_count() if on_gpu else 2)
    with tempfile.TemporaryDirectory() as workdir:
        tiny = write_tiny_model(os.path.join(workdir, "tiny"), TINY)
        ok = check_parity(world, workdir, tiny)
        if not on_gpu:
            return 0 if ok & check_in_place_sync(tiny, make_batch(TINY.vocab_size, rows=8, width=24)) else 1
        qwen05b = write_tiny_model(os.path.join(workdir, "qwen05b"), QWEN25_05B)
        ok &= check_in_place_sync(qwen05b, make_batch(QWEN25_05B.vocab_size, rows=4, width=256))
        if not args.skip_throughput:
            throughput(workdir, qwen05b, shapes=[(16, 512), (4, 2048)], steps=5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
