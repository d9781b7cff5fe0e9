"""`fp8train bench checkpoint` as a script: python benchmarks/bench_checkpoint.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["checkpoint", *sys.argv[1:]]))
