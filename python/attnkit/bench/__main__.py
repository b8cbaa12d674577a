"""Entry point of ``python -m attnkit.bench``."""

import os
import sys

# Before any peer imports torch: its OpenMP threads would otherwise spin between calls and
# take the cores attnkit is being timed on (on 2 cores that halves attnkit's 2-thread rate).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
