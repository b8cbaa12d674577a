#!/usr/bin/env bash
# ThreadSanitizer gate: builds the library and the multi-thread stress test
# (tests/cpp/stress_runtime.cpp: host threads computing while another changes the thread
# count and the ISA, one of them interrupting its calls) with -fsanitize=thread in
# build/tsan, only that target, and runs it; a reported race fails the script.
# Usage: scripts/check_tsan.sh [calls per host thread, default 300]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-300}
cmake -S . -B build/tsan -G Ninja -DATTNKIT_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=TSan \
  "-DCMAKE_CXX_FLAGS_TSAN=-O1 -g -fsanitize=thread" \
  -DCMAKE_EXE_LINKER_FLAGS_TSAN=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS_TSAN=-fsanitize=thread >/dev/null
cmake --build build/tsan -j "$(nproc)" --target attnkit_stress
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
run=(build/tsan/tests/cpp/attnkit_stress "$rounds")
# GCC 12's TSan cannot place its shadow memory under high ASLR entropy
# (vm.mmap_rnd_bits > 28): run without address randomisation where that is allowed.
if setarch "$(uname -m)" -R true 2>/dev/null; then run=(setarch "$(uname -m)" -R "${run[@]}"); fi
"${run[@]}"
