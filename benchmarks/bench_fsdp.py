"""`fp8train bench fsdp` as a script: python benchmarks/bench_fsdp.py [--quick] [--out DIR]."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["fsdp", *sys.argv[1:]]))
