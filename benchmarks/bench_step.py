"""`fp8train bench step` as a script: python benchmarks/bench_step.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["step", *sys.argv[1:]]))
