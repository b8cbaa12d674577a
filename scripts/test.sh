#!/usr/bin/env bash
# Installs what the tests need, then runs every test: the C++ suite (GoogleTest + the
# find_package consumer, via ctest, warnings as errors) and the Python suite (pytest)
# against the pip-installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs=$(nproc)
cmake -S . -B build/test -G Ninja -DATTNKIT_BUILD_TESTS=ON -DATTNKIT_BUILD_BENCH=ON -DATTNKIT_WERROR=ON
cmake --build build/test -j "$jobs"
ctest --test-dir build/test --output-on-failure -j "$jobs"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation .
python3 -m pytest tests/python -q
