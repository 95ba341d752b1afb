"""rlsys command line: python -m rlsys.run <stage> --config FILE [dotted.key=value ...]"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from rlsys.actors.cluster import interrupt_on_sigterm
from rlsys.actors.failures import WorkerFailure
from rlsys.config.loader import ConfigError, load_config
from rlsys.config.schema import EvalJobConfig, PipelineConfig, RLJobConfig, TrainJobConfig
from rlsys.console import setup_console
from rlsys.data.files import DataError


def _pretrain(config: str, overrides: list[str]) -> dict:
    from rlsys.trainers.lm_trainer import run_lm_training

    return run_lm_training(load_config(TrainJobConfig, config, overrides), "pretrain")


def _sft(config: str, overrides: list[str]) -> dict:
    from rlsys.trainers.lm_trainer import run_lm_training

    return run_lm_training(load_config(TrainJobConfig, config, overrides), "sft")


def _eval(config: str, overrides: list[str]) -> dict:
    from rlsys.trainers.eval import run_eval

    return run_eval(load_config(EvalJobConfig, config, overrides))


def _rlvr(config: str, overrides: list[str]) -> dict:
    from rlsys.trainers.rl_trainer import run_rlvr

    return run_rlvr(load_config(RLJobConfig, config, overrides))


def _pipeline(config: str, overrides: list[str]) -> dict:
    from rlsys.trainers.chain import run_pipeline

    return run_pipeline(load_config(PipelineConfig, config, overrides))


STAGES: dict[str, tuple[str, Callable[[str, list[str]], dict]]] = {
    "pretrain": ("next-token pretraining on packed text documents", _pretrain),
    "sft": ("supervised fine-tuning; loss on response tokens only", _sft),
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
        sub.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="override a config key")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_console(args.verbose)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    _, run = STAGES[args.stage]
    interrupt_on_sigterm()
    try:
        run(args.config, args.overrides)
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
