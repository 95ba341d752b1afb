#!/usr/bin/env bash
# A tiny vision-language model learns to count dots: SFT -> GRPO -> eval (examples/vlm/README.md).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" vlm "$@"
