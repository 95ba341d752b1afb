#!/usr/bin/env bash
# The calculator example: a tiny model from scratch learns to call a calculator tool for
# products of 3-digit numbers (SFT on 400 traces), then GRPO with the tool in the loop, then
# evaluation with the tool. Re-running skips finished stages and resumes an interrupted one.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" calc "$@"
