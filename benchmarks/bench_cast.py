"""`fp8train bench cast` as a script: python benchmarks/bench_cast.py [--quick] [--out DIR]
(default: benchmarks/results/, the committed figures, which `fp8train bench` writes only when told)."""

import pathlib
import sys

from fp8train.tools.bench import main

RESULTS = str(pathlib.Path(__file__).resolve().parent / "results")  # a later --out wins

if __name__ == "__main__":
    sys.exit(main(["cast", "--out", RESULTS, *sys.argv[1:]]))
