#!/usr/bin/env bash
# The vllm tier: TRL's use_vllm=True path on vLLM's CPU build, in its own environment (scripts/vllm_venv.sh),
# then its tests: tests/vllm_tier and the TRL-with-vLLM host of the contract suite (marker vllm).
# Usage: scripts/vllm_tier.sh [VENV_DIR] [pytest args...]   (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
shift || true
start=$(date +%s)
scripts/vllm_venv.sh "$venv"
installed=$(date +%s)
# One torch thread and no core pinning (vLLM's CPU backend; tests/vllm_tier/vllm_cpu_support.py sets the rest).
OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind "$venv/bin/python" -m pytest -m vllm -p no:cacheprovider \
    -W ignore::DeprecationWarning -W ignore::FutureWarning tests/vllm_tier tests/hosts/test_trl_vllm_host.py "$@"
end=$(date +%s)
echo "vllm tier: install $((installed - start)) s, tests $((end - installed)) s, total $((end - start)) s"
