#!/usr/bin/env bash
# arctic-inference (vLLM's suffix decoding, `{"method": "suffix"}`) ships on the package index as a source
# distribution only. Build its wheel once (suffix-tree extension only: C++ with nanobind, ~30 s on 2 cores;
# its CUDA ops are built only with ARCTIC_INFERENCE_PRECOMPILED_OPS=1), cache it, install it into VENV.
#
#   scripts/install-arctic.sh VENV        (called by `make setup`)
#
# The build venv and the wheel live in ARCTIC_CACHE (default ~/.cache/draftsmith/arctic), so a second
# checkout or a rerun on the same machine installs the cached wheel in a second.
set -euo pipefail
VENV=${1:?usage: install-arctic.sh VENV}
VERSION=0.3.0
CACHE=${ARCTIC_CACHE:-$HOME/.cache/draftsmith/arctic}
PY="$VENV/bin/python"
tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels="$CACHE/wheels"
wheel=$(ls "$wheels"/arctic_inference-"$VERSION"-"$tag"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    build="$CACHE/build-$tag"
    test -x "$build/bin/python" || "$PY" -m venv "$build"
    # what its pyproject's build-system asks for, in a venv of its own (its protobuf pin is not vLLM's);
    # setup.py imports torch only for CMake's prefix path: VENV's torch (CPU or CUDA) is seen through a
    # .pth file placed after the build venv's own packages, so no second torch is downloaded
    "$build/bin/python" -m pip install -q nanobind==2.9.2 ninja cmake grpcio-tools protobuf==5.29.6 \
        setuptools wheel numpy
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    build_site=$("$build/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" >"$build_site/zz-draftsmith-venv.pth"
    # CMake must find the build venv's python (which has nanobind), not the system's
    CMAKE_ARGS="-DPython_EXECUTABLE=$build/bin/python" "$build/bin/python" -m pip wheel -q \
        --no-build-isolation --no-deps --no-binary arctic-inference "arctic-inference==$VERSION" -w "$wheels.tmp"
    mkdir -p "$wheels"
    mv "$wheels.tmp"/arctic_inference-*.whl "$wheels"/
    rm -rf "$wheels.tmp"
    wheel=$(ls "$wheels"/arctic_inference-"$VERSION"-"$tag"-*.whl | head -n 1)
fi
# --no-deps: its runtime needs are vLLM's own; its plugin patches only the vLLM version it was written for
"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -c 'from arctic_inference.suffix_decoding import SuffixDecodingCache' \
    || { echo "install-arctic: the installed wheel does not import" >&2; exit 1; }
echo "install-arctic: arctic-inference $VERSION from $wheel"
