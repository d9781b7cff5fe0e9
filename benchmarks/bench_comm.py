"""`fp8train bench comm` as a script: python benchmarks/bench_comm.py [--quick] [--ranks 2,4] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["comm", *sys.argv[1:]]))
