"""`fp8train bench checkpoint` as a script: python benchmarks/bench_checkpoint.py [--quick] [--out DIR]
(default: benchmarks/results/, the committed figures, which `fp8train bench` writes only when told)."""

import pathlib
import sys

from fp8train.tools.bench import main

RESULTS = str(pathlib.Path(__file__).resolve().parent / "results")  # a later --out wins

if __name__ == "__main__":
    sys.exit(main(["checkpoint", "--out", RESULTS, *sys.argv[1:]]))
