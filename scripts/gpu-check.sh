#!/usr/bin/env bash
# make gpu-check: draftsmith on a CUDA GPU, end to end, in about 10 minutes once installed (not part of CI).
#
#   1. installs this checkout with its `gpu` extra (CUDA vLLM and the torch it pins) into a venv of its
#      own, .venv-gpu (GPU_CHECK_VENV), beside the CPU venv of `make setup`;
#   2. runs the workflow on the embedded default target (SmolLM2-135M, materialised from its PyPI wheel)
#      with tests/config.tiny.yaml and an overlay on one GPU: vLLM server generation, vLLM extraction,
#      bf16 training, acceptance measured in vLLM with CUDA graphs (scripts/gpu_check.py, OVERLAY);
#   3. prints a table: the stack, each stage's wall time and device, tau per method, speedup.
# Exit 0: every stage ran and the gate passed; it blocks on the contract checks and beats_untrained,
# not on speed (a 135M target: scripts/gpu_check.py, GATE).
#
# Without an NVIDIA GPU it says so in one line and exits 1, before installing anything; so it does without
# a C compiler, the Python headers (arctic-inference builds from source) or a reachable PyPI.
# Output: .gpu-check/ (GPU_CHECK_DIR): the run's folder, snakemake.log, table.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! listing=$(nvidia-smi -L 2>/dev/null) || ! grep -q '^GPU ' <<<"$listing"; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L lists none); run it on a GPU node" >&2
    exit 1
fi

# What the install needs, one line each, before anything is installed (scripts/gpu-prereqs.sh).
source scripts/gpu-prereqs.sh
check_prereqs python3 || { echo "gpu-check: a prerequisite is missing (above); nothing installed" >&2; exit 1; }

VENV=${GPU_CHECK_VENV:-.venv-gpu}
OUT=${GPU_CHECK_DIR:-.gpu-check}
mkdir -p "$OUT"
start=$(date +%s)
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[gpu]'
# suffix decoding (vLLM's `suffix` method): arctic-inference from its source distribution, as `make setup`
bash scripts/install-arctic.sh "$VENV"
echo "gpu-check: installed the gpu extra into $VENV in $(( $(date +%s) - start )) s" | tee "$OUT/install.txt"

# The rules call `draftsmith`: the GPU venv's, first on PATH.
PATH="$(cd "$VENV/bin" && pwd):$PATH" exec "$VENV/bin/python" scripts/gpu_check.py --out "$OUT"
