"""Start-up time: `import fp8train` and `fp8train --help` against `import torch` (fp8train's floor).

Each command runs in a fresh interpreter, the three commands in turn, `repeats` rounds (the first round
warms the file cache and is left out), so that each sees the same machine load; the figure is the
median wall time, and the ratio to `import torch`'s median is the one to watch (goal: within 1.5x).
The modules a command imports beyond `import torch` are counted too (steadier than times): the
compiler (torch._dynamo, inductor, sympy) is what would double the time (tests/test_layers.py
checks that none of it is imported).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

__all__ = ["COMMANDS", "run"]

HELP = "from fp8train.tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
COMMANDS = {
    "import torch": "import torch",
    "import fp8train": "import fp8train",
    "fp8train --help": HELP,
}
COUNT = "\nimport sys\nprint(len(sys.modules), int('torch._dynamo' in sys.modules))"


def _wall_s(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def _modules(code: str) -> tuple[int, bool]:
    out = subprocess.run(
        [sys.executable, "-c", code + COUNT], check=True, capture_output=True, text=True, timeout=600
    )
    count, dynamo = out.stdout.split()[-2:]
    return int(count), dynamo == "1"


def run(repeats: int = 5) -> dict:
    """Median wall time of each command over `repeats` rounds (after one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for round_index in range(repeats + 1):
        for name, code in COMMANDS.items():
            seconds = _wall_s(code)
            if round_index:
                times[name].append(seconds)
    floor = statistics.median(times["import torch"])
    base_modules, _ = _modules(COMMANDS["import torch"])
    rows = []
    for name, code in COMMANDS.items():
        median = statistics.median(times[name])
        modules, dynamo = _modules(code)
        rows.append({
            "command": name,
            "median_s": round(median, 3),
            "min_s": round(min(times[name]), 3),
            "max_s": round(max(times[name]), 3),
            "vs_import_torch": round(median / floor, 2),
            "modules_beyond_torch": modules - base_modules,
            "imports_dynamo": dynamo,
        })  # fmt: skip
    return {"repeats": repeats, "python": sys.executable, "goal_vs_import_torch": 1.5, "rows": rows}
