"""`fp8train bench scale` as a script: python benchmarks/bench_scale.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["scale", *sys.argv[1:]]))
