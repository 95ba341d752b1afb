"""rlsys command line: python -m rlsys.run <stage> --config FILE [dotted.key=value ...]"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import rlsys.tasks  # noqa: F401  (the example tasks register their rewards, `arith` and `calc`)
from rlsys.actors.cluster import interrupt_on_sigterm
from rlsys.actors.failures import WorkerFailure
from rlsys.actors.phases import Heartbeat, set_phase
from rlsys.config.loader import ConfigError, load_config
from rlsys.config.schema import EvalJobConfig, PipelineConfig, RLJobConfig, TrainJobConfig
from rlsys.console import setup_console
from rlsys.data.files import DataError
from rlsys.models.hub import remember_user_offline


def _pretrain(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.lm_trainer import run_lm_training

    return run_lm_training(load_config(TrainJobConfig, config, overrides), "pretrain")


def _sft(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.lm_trainer import run_lm_training

    return run_lm_training(load_config(TrainJobConfig, config, overrides), "sft")


def _rm(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.lm_trainer import run_lm_training

    return run_lm_training(load_config(TrainJobConfig, config, overrides), "rm")


def _eval(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.eval import run_eval

    return run_eval(load_config(EvalJobConfig, config, overrides))


def _rlvr(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.rl_trainer import run_rlvr

    return run_rlvr(load_config(RLJobConfig, config, overrides))


def _pipeline(config: str, overrides: list[str]) -> dict:
    from rlsys.stages.chain import run_pipeline

    return run_pipeline(load_config(PipelineConfig, config, overrides))


STAGES: dict[str, tuple[str, Callable[[str, list[str]], dict]]] = {
    "pretrain": ("next-token pretraining on packed text documents", _pretrain),
    "sft": ("supervised fine-tuning; loss on response tokens only", _sft),
    "rm": ("reward-model training on preference pairs (Bradley-Terry); exports a sequence classifier", _rm),
    "rlvr": ("reinforcement learning with verifiable rewards: vLLM rollouts, rewards, GRPO", _rlvr),
    "pipeline": ("stages chained (e.g. pretrain -> sft -> rlvr -> eval), each from the previous model", _pipeline),
    "eval": ("generate on a test split with vLLM and score with a reward", _eval),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlsys.run",
        description="Ray-based post-training: pretrain, SFT, RLVR and eval of causal language models.",
        epilog="Config keys are documented in docs/configuration.md. Example: "
               "python -m rlsys.run sft --config examples/arith/sft.yaml train.steps=50",
    )
    verbose = "show Ray's, vLLM's and the libraries' logs on the console (they go to output_dir/logs/ otherwise)"
    parser.add_argument("--verbose", "-v", action="store_true", help=verbose)
    stages = parser.add_subparsers(dest="stage", required=True, metavar="<stage>")
    for name, (summary, _) in STAGES.items():
        sub = stages.add_parser(name, help=summary, description=summary)
        sub.add_argument("--config", required=True, metavar="FILE", help="YAML config file")
        sub.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=verbose)
        if name != "pipeline":
            sub.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
        sub.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="override a config key")
    export = stages.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP)
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="a run's checkpoint: RUN/checkpoints/step_N")
    export.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write")
    export.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                        help="the weights' dtype (default: the run's model.export_dtype)")
    export.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=verbose)
    plan = stages.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP)
    plan.add_argument("--config", required=True, metavar="FILE", help="the job's YAML config (RL, SFT or pretrain)")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in the cluster")
    plan.add_argument("--gpu-memory", type=float, required=True, metavar="GiB", help="memory of one GPU")
    plan.add_argument("--gpus-per-node", type=int, default=8, metavar="K", help="GPUs of a node (default 8)")
    plan.add_argument("--prompt-tokens", type=int, default=512, metavar="T",
                      help="RL: the longest prompt; a sequence is this plus rollout.max_new_tokens (default 512)")
    plan.add_argument("--headroom", type=float, default=0.1, metavar="SHARE",
                      help="share of each GPU's memory kept free for what the estimate does not count (default 0.1)")
    plan.add_argument("--host-memory", type=float, default=1024.0, metavar="GiB",
                      help="host memory of a node, where parallel.offload keeps the states (default 1024)")
    plan.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    plan.add_argument("--check", action="store_true",
                      help="run one step of the recommended layout here, scaled down, beside its estimate")
    plan.add_argument("--check-full", action="store_true",
                      help="run rank 0 of the recommended layout here at full size (its peers a fake process group, "
                           "random weights) beside its estimate")
    plan.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=verbose)
    plan.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="override a config key")
    return parser


DRY_RUN_HELP = ("make the checks the stage makes before it starts (model, data, layout, the cluster's resources, "
                "rewards) and exit: no Ray cluster, no training")
EXPORT_HELP = "the Hugging Face directory of any step a run checkpointed, as the run's own export writes it"
PLAN_HELP = "which layouts (pp x dp x cp x tp x ep) of a cluster fit the job, what each rank holds, which to run"


def _plan(args: argparse.Namespace) -> dict:
    from rlsys.planner.job import PlanArgs, run_plan

    sizes = (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory), ("--gpus-per-node", args.gpus_per_node),
             ("--host-memory", args.host_memory))
    for flag, value in sizes:
        if value <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {value:g}")
    return run_plan(PlanArgs(args.config, args.overrides, args.gpus, args.gpu_memory, args.gpus_per_node,
                             args.prompt_tokens, args.headroom, args.host_memory, args.top, args.check,
                             args.check_full))


def _dry_run(stage: str, config: str, overrides: list[str]) -> None:
    from rlsys.stages import preflight

    if stage == "rlvr":
        preflight.check_rl_job(load_config(RLJobConfig, config, overrides))
    elif stage == "eval":
        preflight.check_eval_job(load_config(EvalJobConfig, config, overrides))
    else:
        preflight.check_train_job(load_config(TrainJobConfig, config, overrides), stage)
    print(f"rlsys {stage}: {config} passes the checks a run makes before it starts")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_console(args.verbose)
    remember_user_offline()  # a model named by its Hub id is fetched as the user set it (rlsys.models.hub)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    interrupt_on_sigterm()
    try:
        if args.stage == "plan":
            _plan(args)
        elif args.stage == "export":
            from rlsys.stages.export import run_export

            print(run_export(args.checkpoint, args.out, args.dtype)["hf_model"])
        elif getattr(args, "dry_run", False):
            _dry_run(args.stage, args.config, args.overrides)
        else:
            set_phase(f"{args.stage}: checks and data")  # until the stage names its own phases
            with Heartbeat():
                STAGES[args.stage][1](args.config, args.overrides)
    except (ConfigError, DataError) as err:
        print(f"rlsys {args.stage}: error: {err}", file=sys.stderr)
        return 2
    except WorkerFailure as failure:
        print(f"rlsys {args.stage}: error: {failure}; {failure.resume_hint}".rstrip("; "), file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"rlsys {args.stage}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
