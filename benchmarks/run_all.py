"""Run every benchmark that fits this machine and save the figures under benchmarks/results/."""

import pathlib
import sys

from fp8train.tools.bench import main

RESULTS = str(pathlib.Path(__file__).resolve().parent / "results")  # a later --out wins

if __name__ == "__main__":
    sys.exit(main(["--out", RESULTS, *sys.argv[1:]]))
