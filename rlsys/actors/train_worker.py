"""One rank of the training group, inside a Ray actor: a thin role on the rank's
models (`RankModel`). The policy is one with its optimizer, the reference (for a
KL penalty) and the teacher (distillation) ones without, the critic (PPO) one
with a value head and its own optimizer. The driver calls its methods on
every rank at once (see `train_group.TrainGroup`)."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Literal

import ray
import torch
import torch.distributed as dist
import transformers

from rlsys.actors.cluster import assigned_gpu_index
from rlsys.config.layout import ParallelConfig
from rlsys.config.model import LoraConfig, ModelConfig
from rlsys.config.rl import CriticConfig
from rlsys.config.schema import RLJobConfig, TrainJobConfig
from rlsys.config.training import OptimConfig
from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.data.batching import Batch
from rlsys.host_memory import releases_freed_memory, resident_peak_bytes
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.router_replay import without_routing
from rlsys.sync.gathered import BufferEntry, GatherBuffers, capacity
from rlsys.sync.shards import ShardBucket, Shared, pack
from rlsys.trainer.hf_export import export_hf
from rlsys.trainer.rank_model import LossFn, RankModel, RankModelSpec

Role = Literal["policy", "reference", "teacher", "critic"]
"""The models a training rank may hold: the policy, a frozen reference and teacher, a critic."""

RENDEZVOUS_TIMEOUT_S = 300.0
"""How long the ranks of a group wait for each other to join it (`train.collective_timeout_s`, when
longer, instead)."""


@dataclass(frozen=True)
class TrainWorkerSpec:
    """Everything a rank needs to build its shard of the model and optimizer."""

    model: ModelConfig
    optim: OptimConfig
    parallel: ParallelConfig
    micro_batch_size: int
    total_steps: int
    seed: int
    num_threads: int
    use_gpu: bool
    with_reference: bool = False
    """Also hold a frozen copy of the initial policy (for a KL penalty); a LoRA policy is its own
    reference, with its adapters off."""
    critic: CriticConfig | None = None
    """Also hold a critic (PPO with GAE)."""
    teacher: str | None = None
    """Also hold a frozen teacher from this model directory, in the policy's layout (distillation)."""
    value_head: bool = False
    """The trained model is a reward model: a one-output head in place of the LM head (the `rm` stage),
    exported as a sequence-classification model."""
    collective_timeout_s: float = 600.0
    micro_batch_tokens: int | None = None

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.of(self.parallel)

    def model_spec(self) -> RankModelSpec:
        mixed = self.parallel.mixed_precision
        use_bf16 = mixed == "bf16" or (mixed == "auto" and self.use_gpu)
        parallel = replace(self.parallel, loss_parallel=False) if self.value_head else self.parallel  # one value
        return RankModelSpec(self.model, self.optim, self.dims, parallel, self.micro_batch_size,
                             self.total_steps, torch.bfloat16 if use_bf16 else None,
                             micro_batch_tokens=self.micro_batch_tokens, value_head=self.value_head)

    def teacher_model_spec(self) -> RankModelSpec:
        """The policy's layout and precision over the teacher's weights, without adapters."""
        return replace(self.model_spec(), model=replace(self.model, path=self.teacher, lora=LoraConfig()))

    def critic_model_spec(self) -> RankModelSpec:
        """The policy's layout with the critic's optimizer; no loss parallel (a value is one number); every
        weight trained (no LoRA)."""
        policy = self.model_spec()
        parallel = replace(self.parallel, loss_parallel=False)
        model = replace(self.model, lora=LoraConfig())
        return replace(policy, model=model, optim=self.critic.optim, parallel=parallel, value_head=True)


def build_worker_spec(cfg: TrainJobConfig | RLJobConfig, micro_batch_size: int, total_steps: int,
                      with_reference: bool = False, critic: CriticConfig | None = None,
                      teacher: str | None = None, value_head: bool = False) -> TrainWorkerSpec:
    """The spec of a job config with model, optim, parallel, ray and seed sections (pretrain/SFT/RLVR)."""
    return TrainWorkerSpec(
        model=cfg.model,
        optim=cfg.optim,
        parallel=cfg.parallel,
        micro_batch_size=micro_batch_size,
        total_steps=total_steps,
        seed=cfg.seed,
        num_threads=cfg.ray.cpus_per_worker,
        use_gpu=cfg.ray.gpus_per_worker > 0,
        with_reference=with_reference,
        critic=critic,
        teacher=teacher,
        value_head=value_head,
        collective_timeout_s=cfg.train.collective_timeout_s,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
    )


class TrainWorker:
    def __init__(self, rank: int, spec: TrainWorkerSpec):
        self.startup, self.reused = StartupClock(), False
        redirect_actor_output()
        transformers.utils.logging.disable_progress_bar()
        self._become(rank, spec)

    def _become(self, rank: int, spec: TrainWorkerSpec) -> None:
        self.rank, self.spec = rank, spec
        torch.set_num_threads(spec.num_threads)
        self.device = torch.device("cuda", assigned_gpu_index()) if spec.use_gpu else torch.device("cpu")
        self.policy = self.reference = self.critic = self.teacher = None
        self.gather_buffers: GatherBuffers | None = None
        """Where this rank writes gathered buckets for the engine beside it (`share_gather_buffers`)."""

    def release(self) -> bool:
        """Drop this rank's models and leave its process group, keeping the process and its imports
        for a rank of another group (`reuse`; `rlsys.actors.kept_actors`)."""
        self._become(self.rank, self.spec)
        self.shutdown()
        ParallelDims.forget_meshes()
        gc.collect()
        if self.spec.use_gpu:
            torch.cuda.empty_cache()
        return True

    def reuse(self, log_file: str | None, rank: int, spec: TrainWorkerSpec) -> None:
        """After `release`: become rank `rank` of a new group with `spec` (then `setup`, as a new
        actor is), writing to `log_file`."""
        self.startup, self.reused = StartupClock(), True
        redirect_actor_output(log_file)
        self._become(rank, spec)

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    @releases_freed_memory
    def setup(self, master_addr: str, master_port: int) -> tuple[int, bool]:
        """Join the process group, build the rank's models; returns (data-parallel rank, collected?)."""
        spec = self.spec
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if spec.use_gpu:
            torch.cuda.set_device(self.device)
        backend = "cpu:gloo,cuda:nccl" if spec.use_gpu else "gloo"
        # The ranks meet with a limit of their own: on a busy machine one may reach this call long after
        # another (its imports alone take seconds), which is start-up, not a hung collective.
        store = dist.TCPStore(master_addr, master_port, spec.dims.world_size, is_master=self.rank == 0,
                              timeout=timedelta(seconds=max(spec.collective_timeout_s, RENDEZVOUS_TIMEOUT_S)))
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=spec.dims.world_size,
                                timeout=timedelta(seconds=spec.collective_timeout_s))
        mesh = spec.dims.build_mesh(self.device.type)
        torch.manual_seed(spec.seed)
        self.policy = RankModel(spec.model_spec(), mesh, self.device)
        copy_reference = spec.with_reference and not spec.model.lora.rank
        self.reference = RankModel(spec.model_spec(), mesh, self.device, trainable=False) \
            if copy_reference else None
        self.critic = RankModel(spec.critic_model_spec(), mesh, self.device) if spec.critic else None
        self.teacher = RankModel(spec.teacher_model_spec(), mesh, self.device, trainable=False) \
            if spec.teacher else None
        self.where = spec.dims.coordinates(self.rank)
        record_startup("train", self.startup, self.reused)
        return self.where.dp_rank, self.where.collected

    # -- training -----------------------------------------------------------

    @releases_freed_memory
    def train_step(self, shard: Batch, loss_fn: LossFn) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """forward_backward, then one optimizer step: metrics plus grad_norm and lr, and the
        loss function's per-row outputs from before the step (empty off the last pipeline stage)."""
        metrics, rows = self.policy.forward_backward(shard, loss_fn)
        return {**metrics, **self.policy.optimizer_step()}, rows

    @releases_freed_memory
    def evaluate(self, shard: Batch, loss_fn: LossFn) -> dict[str, float]:
        """`loss_fn`'s metrics over the shard without grad or a step (held-out data), summed over
        the data-parallel ranks."""
        metrics, _ = self.policy.forward_backward(shard, loss_fn, forward_only=True)
        return metrics

    @releases_freed_memory
    def forward(self, shard: Batch, loss_fn: LossFn, role: Role = "policy", record_routing: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A pass without grad of one of this rank's models over the shard (log-probs, values, a teacher's
        top tokens: whatever `loss_fn` outputs): its rows, [B, T, ...] aligned with input_ids (empty on a
        pipeline stage before the last), and the pass's metrics, summed over the data-parallel ranks.
        The policy routes as the shard says (R3: the rollout engine's experts, and `router/replay_agreement`,
        how often its own routers chose them); with `record_routing` the experts its routers chose come
        back ("routed_experts": what R2 replays). The other roles route on their own. A LoRA policy's
        reference is the policy with its adapters off."""
        if role != "policy":
            shard = without_routing(shard)
        if role == "reference" and self.reference is None:
            with self.policy.adapters_off():
                metrics, rows = self.policy.forward_backward(shard, loss_fn, forward_only=True)
            return rows, metrics
        model = {"policy": self.policy, "reference": self.reference, "teacher": self.teacher, "critic": self.critic}
        metrics, rows = model[role].forward_backward(shard, loss_fn, forward_only=True, record_routing=record_routing)
        return rows, metrics

    @releases_freed_memory
    def critic_step(self, shard: Batch, loss_fn: LossFn) -> dict[str, float]:
        """forward_backward of the value loss, then one critic optimizer step."""
        metrics, _ = self.critic.forward_backward(without_routing(shard), loss_fn)
        return {**metrics, **{f"critic/{k}": v for k, v in self.critic.optimizer_step().items()}}

    # -- weights for the rollout engines ------------------------------------

    def parameter_nbytes(self) -> dict[str, int]:
        """The weights the engines receive, by HF name (a LoRA policy's: merged)."""
        weights = self.policy.weights
        return weights.merged_nbytes() if self.policy.lora else weights.parameter_nbytes()

    def sync_shards(self, names: list[str]) -> ShardBucket | None:
        """This rank's shards of `names`, for the engines to reassemble (None when it
        holds only replicas of them)."""
        weights = self.policy.weights
        shards = weights.merged_shards(names) if self.policy.lora else weights.local_shards(names)
        return pack(shards) if shards else None

    def adapter_shards(self) -> ShardBucket | None:
        """This rank's shards of the policy's LoRA adapters (None: it holds only replicas)."""
        shards = self.policy.weights.local_shards(self.policy.weights.adapter_names())
        return pack(shards) if shards else None

    def share_shards(self, names: list[str]) -> list[Shared]:
        """Handles to this rank's shards of `names` (moved into shared memory on CPU) for engines on
        this machine to read in place at every sync (none of them: this rank holds only replicas)."""
        return self.policy.weights.share_shards(names)

    def share_gather_buffers(self, buckets: list[list[str]], engine_dtype: torch.dtype | None) -> list[Shared]:
        """Staging buffers for gathered buckets (`rlsys.sync.gathered`), each as large as the largest of
        `buckets` in the engine's dtype, and handles to them for the engine beside this rank to map."""
        params = dict(self.policy.weights.named_parameters())
        self.gather_buffers = GatherBuffers(capacity(buckets, params, engine_dtype), self.device)
        return self.gather_buffers.share()

    def gather_bucket(self, names: list[str], slot: int, engine_dtype: torch.dtype | None) -> list[BufferEntry] | None:
        """The full tensors of `names`, gathered from the ranks of this pipeline stage (a collective: each
        of them calls this) and written into staging buffer `slot` for the engine beside this rank; where
        each lies (None: no engine reads from this rank)."""
        tensors = self.policy.weights.bucket_tensors(names, engine_dtype)
        if self.gather_buffers is None:  # this rank took its part in the collectives
            return None
        return self.gather_buffers.write(slot, tensors, engine_dtype)

    # -- state --------------------------------------------------------------

    @releases_freed_memory
    def save_checkpoint(self, path: str) -> None:
        self.policy.state.save(path, self.rank)
        if self.critic is not None:
            os.makedirs(os.path.join(path, "critic"), exist_ok=True)
            self.critic.state.save(os.path.join(path, "critic"), self.rank)

    @releases_freed_memory
    def load_checkpoint(self, path: str) -> None:
        self.policy.state.load(path, self.rank)
        if self.critic is not None:
            self.critic.state.load(os.path.join(path, "critic"), self.rank)

    @releases_freed_memory
    def empty_gpu_cache(self) -> None:
        """Give the GPU memory the caching allocator holds free (the update's peak) back to the device,
        for the engines colocated with this rank to wake into."""
        torch.cuda.empty_cache()

    def memory_peaks(self) -> dict[str, float]:
        """The most memory this rank used since the last call, in GiB: on a GPU, what its tensors took
        ("allocated") and its caching allocator held ("reserved"); on CPU, what its process held resident
        ("resident": tensors, allocator arenas, libraries)."""
        if self.device.type != "cuda":
            resident = resident_peak_bytes()
            return {} if resident is None else {"resident": resident / 2**30}
        peaks = {"allocated": torch.cuda.max_memory_allocated(self.device) / 2**30,
                 "reserved": torch.cuda.max_memory_reserved(self.device) / 2**30}
        torch.cuda.reset_peak_memory_stats(self.device)
        return peaks

    def export_hf(self, out_dir: str) -> None:
        export_hf(self.policy.weights, self.spec.model, out_dir, self.where.pp, self.spec.dims.pp,
                  writes_stage=self.where.leads_stage, writes_config=self.rank == 0, reward_head=self.spec.value_head)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
