#!/usr/bin/env bash
# Makes the virtual environment that ops/bench/trl_grpo.py (the TRL side of grpo_vs_trl.py and
# engine_only.py) runs in. TRL lives in its own venv because it pins its own transformers /
# accelerate / datasets, which streamrl's environment should not have to follow.
#
# Usage: bash ops/bench/setup_trl_env.sh [VENV_DIR]
#   VENV_DIR defaults to $STREAMRL_TRL_VENV, else /tmp/streamrl-trl-venv2 (what grpo_vs_trl.py looks for).
#   PYTHON=python3.11           interpreter the venv is made from (default python3)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#                               where torch comes from (default: pip's configured index; on Linux
#                               PyPI's torch wheel is the CUDA one, this URL gives the CPU-only one)
#
# Versions: exactly those the reference TRL figures in docs/benchmarks.md were taken with; other
# versions run (the runner warns) but their figures do not compare. streamrl itself is not
# installed: the runner puts its own checkout first on sys.path, so the model, tokenizer and tasks
# it trains are always the code beside it; only msgspec and pyzmq, which those modules import and the TRL
# stack does not bring, are added (streamrl.tasks imports the reward client, hence pyzmq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${1:-${STREAMRL_TRL_VENV:-/tmp/streamrl-trl-venv2}}
python=${PYTHON:-python3}

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)

# torch first, pinned: installing TRL first would let pip pick the newest torch (and its CUDA stack).
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
    "${pip[@]}" torch==2.13.0
fi
# torch==2.13.0 is repeated so that resolving the rest can never move it.
"${pip[@]}" torch==2.13.0 trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 \
    tokenizers==0.23.3 "msgspec>=0.18" "pyzmq>=25"

# Imports TRL and this checkout's streamrl modules, prints the versions, warns on a mismatch.
"$venv/bin/python" "$here/trl_grpo.py" --check-env
echo "TRL venv ready: $venv/bin/python $here/trl_grpo.py --help"
