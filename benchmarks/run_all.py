"""Run every benchmark that fits this machine and save the figures under benchmarks/results/."""

import sys

from fp8train.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
