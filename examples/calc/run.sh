#!/usr/bin/env bash
# The calculator example: a tiny model from scratch imitates a demonstrator who calls a calculator
# tool on a third of its products of 3-digit numbers (SFT), then GRPO with the tool in the loop
# learns to call it, then evaluation with the tool. Re-running skips finished stages and resumes
# an interrupted one.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" calc "$@"
