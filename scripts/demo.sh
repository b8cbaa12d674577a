#!/usr/bin/env bash
# Installs attnkit and runs the main job: the benchmark on the default shapes, each result
# verified against a float64 reference before it is timed (--quick: under a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
python3 -m pip install -q --disable-pip-version-check --no-build-isolation .
cd /tmp && python3 -m attnkit.bench "$@"
