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

import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

import fp8train
from fp8train.tools.ranks import AllReduceSpy, assert_ok, free_port, run_ranks, run_ranks_outcomes

__all__ = [
    "CollectiveCounter", "train_fsdp_gathers", "assert_fp8_gathers_bit_for_bit",
    "AllReduceSpy", "assert_ok", "free_port", "run_ranks", "run_ranks_outcomes", "run_scenarios",
    "run_scenarios_together", "scenario_outcome",
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


def run_scenarios_together(
    scenarios: dict[str, Callable[[int, int, str], Any]],
    rank: int,
    world: int,
    names: list[str],
    directory: str,
) -> dict[str, tuple[str, Any]]:
    """Inside a rank: `run_scenarios` of the named `scenarios` (fn(rank, world, its own directory)),
    each from a fresh fp8train registry, every rank starting each one together (a barrier after each,
    whatever it did)."""

    def run_one(name: str):
        fp8train.inspection.reset()
        try:
            return scenarios[name](rank, world, os.path.join(directory, name))
        finally:
            dist.barrier()

    return run_scenarios(names, run_one)


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


def train_fsdp_gathers(
    shard: Callable[[bool], torch.nn.Module], loss_of: Callable[[torch.nn.Module, int], torch.Tensor]
) -> dict[bool, dict]:
    """Inside a rank: for fsdp_fp8_all_gather off, then on, the model `shard(option)` builds and shards
    (from a fresh registry), trained 3 SGD steps on `loss_of(model, step)` under delayed scaling with its
    collectives counted: {option: {"steps": a digest per step (loss, full gradients, FP8 state),
    "gathers": the gathered dtypes}}."""
    from helpers import digest, fp8_state

    out = {}
    for option in (False, True):
        fp8train.inspection.reset()
        model = shard(option)
        counter = CollectiveCounter()
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            snapshots = []
            for step in range(3):
                with fp8train.fp8_autocast(fp8_recipe=fp8train.DelayedScaling(amax_history_len=4)):
                    loss = loss_of(model, step)
                loss.backward()
                grads = [p.grad.full_tensor() for p in model.parameters()]
                snapshots.append(digest([loss.detach(), grads, fp8_state(model)]))
                opt.step()
                opt.zero_grad()
        finally:
            counter.close()
        out[option] = {"steps": snapshots, "gathers": counter.gather_dtypes}
    return out


def assert_fp8_gathers_bit_for_bit(runs: list[dict[bool, dict]]) -> None:
    """The ranks' `train_fsdp_gathers` results: with FP8 gathers each rank trains bit for bit as with
    high-precision ones and gathers bytes (uint8) only, the others fp32 only; the ranks' runs differ
    (per-rank data: a real run)."""
    for out in runs:
        assert out[True]["steps"] == out[False]["steps"]
        assert out[True]["gathers"] and all(d == torch.uint8 for d in out[True]["gathers"])
        assert all(d == torch.float32 for d in out[False]["gathers"])
    assert runs[0][True]["steps"][-1] != runs[1][True]["steps"][-1]
