"""python -m attnkit info: version, kernel variant, threads and build facts."""

import sys

from . import _C
from .bench.machine import bf16_dot_of, int8_dot_of


def info() -> str:
    isa = _C.active_isa()
    lines = [
        f"attnkit {_C.version()}",
        f"isa: {_C.active_isa()} (supported here: {', '.join(_C.supported_isas())})",
        f"default isa: {_C.isa_rule()}",
        f"bf16 products on: {bf16_dot_of(isa)}; int8 Sage Q·Kᵀ on: {int8_dot_of(isa)}",
        f"threads: {_C.get_num_threads()}",
        f"cpu features: {_C.cpu_features()}",
        f"build: {_C.build_info()}",
    ]
    return "\n".join(lines)


def main(argv) -> int:
    if argv[1:] == ["info"]:
        print(info())
        return 0
    print("usage: python -m attnkit info   (benchmarks: python -m attnkit.bench)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
