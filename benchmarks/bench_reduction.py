"""`fp8train bench reduction` as a script: python benchmarks/bench_reduction.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["reduction", *sys.argv[1:]]))
