"""`fp8train bench optim` as a script: python benchmarks/bench_optim.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["optim", *sys.argv[1:]]))
