#!/usr/bin/env bash
# The arithmetic pipeline with a tiny MoE model on 2 expert-parallel ranks (examples/moe/README.md).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" moe "$@"
