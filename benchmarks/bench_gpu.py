"""`fp8train bench gpu` as a script: python benchmarks/bench_gpu.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["gpu", *sys.argv[1:]]))
