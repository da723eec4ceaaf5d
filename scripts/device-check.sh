#!/usr/bin/env bash
# The checks a lent single-GPU machine can run in a few minutes (issue 43): torch and transformers only, no
# vLLM, no network, no weights. Prints bench.device_check's table (format: docs/gpu.md, "Checks on a
# lent GPU"): training peak memory against the plan for a Llama-3.1-8B- and a Kimi-K2.5-shaped drafter,
# training tokens/s, the TTT mask's memory before and after the stride fix, a DDP step under NCCL per
# drafter kind. At most 8 minutes (DEVICE_CHECK_TIMEOUT_S, default 480). Extra arguments go to the module.
#
# Without CUDA it says so in one line and exits 1. PYTHON: the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "device-check: CUDA is not available here (torch sees no GPU, or no torch for $PYTHON); run it on a GPU machine" >&2
    exit 1
fi
exec timeout -k 10 "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PYTHON" -m bench.device_check "$@"
