"""`fp8train bench cast` as a script: python benchmarks/bench_cast.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["cast", *sys.argv[1:]]))
