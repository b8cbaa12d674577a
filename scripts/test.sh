#!/usr/bin/env bash
# Installs what the tests need (into the project's .venv, see install_deps.sh), then runs
# every test: the C++ suite (GoogleTest + the find_package consumer, via ctest, warnings as
# errors), the Python suite (pytest) against the pip-installed package, and the reliability
# gates: the C++ tests and ~2 minutes of seeded random-call fuzzing under ASan+UBSan
# (check_sanitizers.sh), and a multi-thread stress test under TSan (check_tsan.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
export PATH="$PWD/.venv/bin:$PATH"  # the venv's cmake and ninja, and its python
jobs=$(nproc)
cmake -S . -B build/test -G Ninja -DATTNKIT_BUILD_TESTS=ON -DATTNKIT_BUILD_BENCH=ON -DATTNKIT_WERROR=ON
cmake --build build/test -j "$jobs"
ctest --test-dir build/test --output-on-failure -j "$jobs"
python -m pip install -q --disable-pip-version-check --no-build-isolation .
python -m pytest tests/python -q
bash scripts/check_sanitizers.sh
bash scripts/check_tsan.sh
