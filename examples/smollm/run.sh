#!/usr/bin/env bash
# The real-model example: SmolLM2-135M-Instruct (from the package registry, converted once) learns to
# pick the largest or smallest number of a list: held-out accuracy of the model as it comes, after a
# short SFT warm-up, and after GRPO. Re-running skips finished stages and resumes an interrupted one.
# With LoRA: .venv/bin/python -m rlsys.run pipeline --config examples/smollm/pipeline_lora.yaml
exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/example.sh" smollm "$@"
