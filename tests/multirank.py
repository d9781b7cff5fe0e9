"""The tests' one multi-rank harness: everything a test needs to run and check real gloo ranks.

The launcher (`run_ranks`, `run_ranks_outcomes`, `assert_ok`) and `AllReduceSpy` live in the toolbox
(`fp8train.tools.ranks`) because the benchmarks and the examples spawn ranks with them too; this module
re-exports them and adds what only tests use: running many scenarios in one set of ranks.

Rank processes unpickle a test's worker function by its module name: pytest's `pythonpath` option
(pyproject.toml) puts tests/ on sys.path and collection puts each test folder there, and the
forkserver that starts the ranks copies the parent's sys.path, so helpers and test modules import in
the ranks as in the parent.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

from fp8train.tools.ranks import AllReduceSpy, assert_ok, free_port, run_ranks, run_ranks_outcomes

__all__ = [
    "AllReduceSpy", "assert_ok", "free_port", "run_ranks", "run_ranks_outcomes", "run_scenarios",
    "scenario_outcome",
]  # fmt: skip


def run_scenarios(names: list[str], run_one: Callable[[str], Any]) -> dict[str, tuple[str, Any]]:
    """Inside a rank: run_one(name) for each name in turn, so that one set of ranks serves many
    scenarios; ("ok", result) or ("error", traceback) per name, a failure not stopping the others."""
    out = {}
    for name in names:
        try:
            out[name] = ("ok", run_one(name))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def scenario_outcome(runs: list[dict], name: str) -> list:
    """Each rank's result of scenario `name` (from run_scenarios); raises with a failing rank's traceback."""
    for rank, run in enumerate(runs):
        status, value = run[name]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed in scenario {name!r}:\n{value}")
    return [run[name][1] for run in runs]
