"""`fp8train bench fused` as a script: python benchmarks/bench_fused.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["fused", *sys.argv[1:]]))
