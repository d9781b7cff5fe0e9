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

import torch
import torch.distributed as dist

from fp8train.tools.ranks import AllReduceSpy, assert_ok, free_port, run_ranks, run_ranks_outcomes

__all__ = [
    "CollectiveCounter",
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


class CollectiveCounter:
    """Wraps the collectives until `close()`: bytes and dtype FSDP2 all-gathers (per call) and the amax
    all-reduces. `gather_dtypes`: the dtypes gathered (FP8 gathers move uint8)."""

    def __init__(self) -> None:
        self.gathers: list[tuple[int, torch.dtype]] = []
        self.all_reduces = 0
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self._restore = [(name, getattr(dist, name)), ("all_reduce", dist.all_reduce)]
        gather, all_reduce = self._restore[0][1], dist.all_reduce

        def counted_gather(*args, **kwargs):  # FSDP2 passes the tensors by keyword in torch 2.6
            input = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            self.gathers.append((input.numel() * input.element_size(), input.dtype))
            return gather(*args, **kwargs)

        def counted_all_reduce(*args, **kwargs):
            self.all_reduces += 1
            return all_reduce(*args, **kwargs)

        setattr(dist, name, counted_gather)
        dist.all_reduce = counted_all_reduce

    @property
    def gather_dtypes(self) -> list[torch.dtype]:
        return [dtype for _, dtype in self.gathers]

    def reset(self) -> None:
        self.gathers, self.all_reduces = [], 0

    def close(self) -> None:
        for name, fn in self._restore:
            setattr(dist, name, fn)
