#!/usr/bin/env bash
# The vLLM engine's tests on a GPU machine, in one go:
#   bash services/engines/vllm/gpu_check.sh
# writes everything to stdout and, when $OUT is set, to $OUT/vllm-tests.txt. Exits with pytest's
# status (0 when the tests passed or were all skipped, with the reasons listed).
#
# Python: the first of $RIPPLEMESH_VLLM_PYTHON, .venv/bin/python, $RIPPLEMESH_VLLM_VENV/bin/python
# (default ~/.cache/ripplemesh/venv-vllm) that imports vllm and pytest. When none does, it makes
# that venv and installs the project with its dev and vllm extras into it (this needs PyPI; vllm
# brings its own torch, so the project's CPU .venv is left alone).
#
# Model: $RIPPLEMESH_VLLM_MODEL when set. Otherwise the first local directory that holds a model
# vLLM can load offline (config.json, tokenizer files and *.safetensors), looked for in
# shared/models, $RIPPLEMESH_MODELS_DIR, /models, /data/models, /opt/models, $HOME/models and the
# Hugging Face cache ($HF_HOME or ~/.cache/huggingface, hub/models--*/snapshots/*), small models
# first (names with 0.5B, 135M, 360M, 125m, tiny, small, mini). Without one the tests are skipped
# with a reason that says so. Nothing is downloaded: HF_HUB_OFFLINE=1.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$ROOT" || exit 2
VENV="${RIPPLEMESH_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ripplemesh/venv-vllm}"
LOG="$(mktemp -t vllm-tests.XXXXXX)"

usable() {
  [ -n "$1" ] && [ -x "$1" ] && "$1" -c "import vllm, pytest, pytest_asyncio, msgspec" >/dev/null 2>&1
}

pick_python() {
  local py
  for py in "${RIPPLEMESH_VLLM_PYTHON:-}" "$ROOT/.venv/bin/python" "$VENV/bin/python"; do
    if usable "$py"; then
      echo "$py"
      return 0
    fi
  done
  echo "no Python with vllm here: installing '.[dev,vllm]' into $VENV" >&2
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >&2 || return 1
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev,vllm]" >&2 || return 1
  usable "$VENV/bin/python" && echo "$VENV/bin/python"
}

is_model_dir() {
  [ -f "$1/config.json" ] && compgen -G "$1/*.safetensors" >/dev/null \
    && { [ -f "$1/tokenizer.json" ] || [ -f "$1/tokenizer.model" ] || [ -f "$1/vocab.json" ]; }
}

find_model() {
  local hf="${HF_HOME:-$HOME/.cache/huggingface}" candidates=() dir
  local roots=("$ROOT/shared/models" "${RIPPLEMESH_MODELS_DIR:-}" /models /data/models /opt/models "$HOME/models")
  for root in "${roots[@]}"; do
    [ -n "$root" ] && [ -d "$root" ] || continue
    is_model_dir "$root" && candidates+=("$root")
    for dir in "$root"/*/ "$root"/*/*/; do
      is_model_dir "${dir%/}" && candidates+=("${dir%/}")
    done
  done
  for dir in "$hf"/hub/models--*/snapshots/*/; do
    is_model_dir "${dir%/}" && candidates+=("${dir%/}")
  done
  [ "${#candidates[@]}" -gt 0 ] || return 1
  for dir in "${candidates[@]}"; do
    case "${dir,,}" in
      *0.5b* | *135m* | *360m* | *125m* | *tiny* | *small* | *mini*) echo "$dir"; return 0 ;;
    esac
  done
  echo "${candidates[0]}"
}

main() {
  echo "== ripplemesh vLLM engine check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo "== commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
  else
    echo "== no nvidia-smi on this machine"
  fi
  local py
  if ! py="$(pick_python)"; then
    echo "== FAILED: could not get a Python with vllm (pip install '.[dev,vllm]' needs PyPI)"
    return 3
  fi
  echo "== python: $py"
  "$py" -c "import sys, vllm, torch; print('python', sys.version.split()[0], '| vllm', vllm.__version__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())" 2>&1
  "$py" -c "import nixl" >/dev/null 2>&1 && echo "== nixl: present" || echo "== nixl: absent (the P/D hand-off test will skip)"

  if [ -z "${RIPPLEMESH_VLLM_MODEL:-}" ]; then
    RIPPLEMESH_VLLM_MODEL="$(find_model)" || RIPPLEMESH_VLLM_MODEL=""
  fi
  export RIPPLEMESH_VLLM_MODEL
  echo "== model: ${RIPPLEMESH_VLLM_MODEL:-none found (tests will skip)}"
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
  export VLLM_WORKER_MULTIPROC_METHOD="${VLLM_WORKER_MULTIPROC_METHOD:-spawn}"
  export PYTORCH_NVML_BASED_CUDA_CHECK=1

  local tests=(tests/engines/test_vllm.py)
  [ -f tests/engines/test_contract.py ] && tests+=(tests/engines/test_contract.py)
  echo "== pytest ${tests[*]} -k vllm"
  timeout "${RIPPLEMESH_VLLM_TEST_TIMEOUT:-1500}" \
    "$py" -m pytest "${tests[@]}" -k vllm -q -rs -p no:cacheprovider
  local rc=$?
  echo "== pytest exit status: $rc"
  if [ "$rc" -eq 5 ]; then
    echo "== no test ran (all skipped or deselected): see the reasons above"
    rc=0
  fi
  return "$rc"
}

main 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && cp "$LOG" "$OUT/vllm-tests.txt" && chmod 644 "$OUT/vllm-tests.txt"
fi
rm -f "$LOG"
exit "$rc"
