#!/usr/bin/env bash
# Installs Horovod into the project's environment for bench/bench_horovod.py (a benchmark dependency:
# nothing in ssdsgd/ or tests/ needs it). Horovod has no wheel on PyPI: it compiles against the MXNet
# already installed, with Gloo for CPU all-reduce (no MPI, no GPU). Takes about 10-15 minutes on 2 cores.
#
# Needs: a C++17 compiler (g++ or clang++), cmake >= 3.13 (installed from PyPI into the venv when missing),
# and a venv that already holds mxnet 1.9.1 and numpy < 1.24 (make setup).
# Usage: bench/install_horovod.sh [VENV]   (default .venv); VERSION=0.28.1 overrides the version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${1:-.venv}")
VERSION=${VERSION:-0.28.1}
PY="$VENV/bin/python"

[ -x "$PY" ] || { echo "install_horovod: no $PY (run make setup first)" >&2; exit 2; }
"$PY" -c 'import mxnet' 2>/dev/null || { echo "install_horovod: mxnet is not installed in $VENV" >&2; exit 2; }
if "$PY" -c 'import horovod.mxnet' 2>/dev/null; then
    echo "install_horovod: horovod $("$PY" -c 'import horovod; print(horovod.__version__)') already in $VENV"
    exec "$VENV/bin/horovodrun" --check-build
fi
CXX=${CXX:-$(command -v g++ || command -v clang++ || true)}
[ -n "$CXX" ] || { echo "install_horovod: needs a C++ compiler (e.g. apt-get install g++)" >&2; exit 2; }
export CXX
# The build runs cmake from the venv's PATH first, so a PyPI cmake there is found.
export PATH="$VENV/bin:$PATH"
if ! command -v cmake >/dev/null; then
    echo "install_horovod: no cmake, installing it from PyPI into $VENV"
    "$PY" -m pip install -q 'cmake>=3.13,<4'
fi
echo "install_horovod: compiler $CXX, $(cmake --version | head -1)"
"$PY" -m pip install -q -c constraints.txt setuptools wheel
# --no-build-isolation: the build must import the venv's mxnet to find libmxnet.so and its headers;
# in pip's isolated build environment cmake stops at "Could NOT find Mxnet".
HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    "$PY" -m pip install -c constraints.txt --no-build-isolation --no-cache-dir "horovod==$VERSION"
"$VENV/bin/horovodrun" --check-build
