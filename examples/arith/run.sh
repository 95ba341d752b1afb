#!/usr/bin/env bash
# The main job: tiny model + arithmetic data, then the pretrain -> SFT -> RLVR -> eval pipeline
# (pretrain and SFT on 2 FSDP2 ranks, RL on one rank beside a vLLM engine, on a local Ray
# cluster). Re-running skips finished stages and resumes an interrupted one.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" arith "$@"
