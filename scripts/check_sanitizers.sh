#!/usr/bin/env bash
# The sanitizer gate: builds the library, the C++ tests and the fuzz driver with
# AddressSanitizer + UndefinedBehaviorSanitizer (-fno-sanitize-recover=all: the first report
# fails) in build/asan, runs the C++ unit tests, then the seeded random-call fuzz driver
# (tests/fuzz/) for ATTNKIT_FUZZ_SECONDS seconds (default 120; set it higher, or
# pass --seconds N, for a longer run). A failing fuzz call prints its seed; replay it with
#   build/asan/tests/fuzz/attnkit_fuzz --replay 0x<seed>
# Usage: scripts/check_sanitizers.sh [--seconds N] [--seed X]
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_args=("$@")
jobs=$(nproc)
# -O1 keeps the build within budget (about half the compile time of -O2 under the
# sanitizers); -g1 gives file:line in reports.
cmake -S . -B build/asan -G Ninja -DATTNKIT_BUILD_TESTS=ON -DATTNKIT_SANITIZE=ON -DATTNKIT_WERROR=ON \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1" >/dev/null
cmake --build build/asan -j "$jobs" --target attnkit_tests attnkit_fuzz
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
# abort_on_error: the fuzz driver's SIGABRT handler then prints the seed of the call in flight.
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1
build/asan/tests/cpp/attnkit_tests --gtest_brief=1
build/asan/tests/fuzz/attnkit_fuzz --seconds "${ATTNKIT_FUZZ_SECONDS:-120}" "${fuzz_args[@]}"
