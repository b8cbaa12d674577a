#!/usr/bin/env bash
# Installs attnkit (into the project's .venv, see install_deps.sh) and runs the main job:
# the benchmark on the default shapes, each result verified against a float64 reference
# before it is timed (--quick: under a minute). --help prints the options and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/.venv"
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    echo "usage: bash scripts/demo.sh [benchmark options]"
    echo "Installs the dependencies and attnkit into .venv, then runs python -m attnkit.bench with the options."
    if [ -x "$venv/bin/python" ] && (cd /tmp && "$venv/bin/python" -c "import attnkit") 2>/dev/null; then
      echo; cd /tmp && exec "$venv/bin/python" -m attnkit.bench --help
    fi
    echo "Benchmark options (--quick, --op, --dtype, --threads, ...): run once without --help, then see"
    echo ".venv/bin/python -m attnkit.bench --help"
    exit 0
  fi
done
bash scripts/install_deps.sh
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation .
cd /tmp && "$venv/bin/python" -m attnkit.bench "$@"
