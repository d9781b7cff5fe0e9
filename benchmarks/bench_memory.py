"""`fp8train bench memory` as a script: python benchmarks/bench_memory.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["memory", *sys.argv[1:]]))
