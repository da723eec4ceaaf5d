# Sourced by scripts/gpu-check.sh: what the GPU install needs besides the GPU, checked before anything is
# installed, one line each. arctic-inference (suffix decoding) builds from source: a C/C++ compiler and
# the Python headers; pip fetches vLLM, torch and the rest from PyPI: the node must reach it.
# Each check prints one line and returns 1 when the thing is missing (tests/unit/test_gpu_check.py).

check_compiler() {
    local cc
    for cc in "${CC:-}" cc gcc; do
        if [[ -n $cc ]] && command -v "$cc" >/dev/null 2>&1; then
            echo "gpu-check: compiler $cc found"
            return 0
        fi
    done
    echo "gpu-check: no C compiler (cc, gcc) on PATH: arctic-inference builds from source (install gcc, g++)" >&2
    return 1
}

check_python_headers() {
    local python=${1:-python3} include
    include=$("$python" -c 'import sysconfig; print(sysconfig.get_path("include"))' 2>/dev/null) || include=""
    if [[ -n $include && -f $include/Python.h ]]; then
        echo "gpu-check: Python headers found ($include/Python.h)"
        return 0
    fi
    echo "gpu-check: no Python.h for $python (sysconfig include: ${include:-?}): install the python3-dev package" >&2
    return 1
}

check_pypi() {
    local python=${1:-python3} index=${PIP_INDEX_URL:-https://pypi.org/simple}
    # the index's page for one small project, within a short timeout (a firewalled node hangs, not fails)
    if timeout "${GPU_CHECK_PYPI_TIMEOUT:-20}" "$python" -m pip index versions pip --index-url "$index" \
        >/dev/null 2>&1; then
        echo "gpu-check: package index reachable ($index)"
        return 0
    fi
    echo "gpu-check: the package index $index is not reachable from this node: pip installs vLLM and torch from it" >&2
    return 1
}

check_prereqs() {
    local python=${1:-python3} failed=0
    check_compiler || failed=1
    check_python_headers "$python" || failed=1
    check_pypi "$python" || failed=1
    return $failed
}
