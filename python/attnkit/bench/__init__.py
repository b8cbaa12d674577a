"""attnkit's benchmark tool: ``python -m attnkit.bench`` (protocol: docs/BENCH.md).

Each op (``attention``, ``sparse_mla``) is an entry of :data:`registry.OPS` that knows its
shapes, inputs, contenders (attnkit and its peers), reference check and FLOP count; the
driver in :mod:`attnkit.bench.runner` verifies every contender first, then times them
interleaved and reports ratios against attnkit.
"""


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
