"""Imported once by `run_ranks`' forkserver (fp8train.tools.ranks): it compiles there the CPU kernels a
rank compiles on its first FP8 steps, so that every rank forked from the server starts with them.

A fresh process's first FP8 step loads fp8train's compiled kernels (`numerics/cast.py`'s cast,
`numerics/gemm_output.py`'s GEMM output) through dynamo and inductor, from inductor's on-disk cache:
about 7 s of a 2-core AMD EPYC per process (3 s of it importing dynamo and inductor), paid by every
rank of every multi-rank test. Compiled here (about 9 s, once per server), the server's kernels
are inherited by each fork, which calls them directly (`torch_internals.DirectlyCalled`) from its
first step on, and so are dynamo and inductor, imported (1.5 s of a rank's first FP8 step even
where no tensor is large enough for the kernels; pipelining imports dynamo too). The test suite's
197 ranks took 1,639 s in all before (513 s in the kernels' first calls), 318 s after (2026-12-03,
`pytest -n 0 -m multirank`, the same shared machine).

`warm()` runs one small FP8 training step per scaling kind (delayed: casts that take the amax;
current: casts that do not), of a linear layer with a bias and one without, forward and backward, in
float32: the public API compiles what a rank's step compiles, whatever variants the kernels have.
It compiles them as a rank would (inductor's CPU kernels specialize on the thread count: one thread,
the ranks' count) and leaves nothing else behind for the ranks:

- no thread: a thread's pool would be dead in a fork, a lock it held forever held (inductor's
  compile pool: `compile_threads=1` while it compiles; tqdm's monitor, which dynamo's progress bar
  starts: stopped);
- no fp8train state (a fresh registry, zeroed counters); the random generator as it was;
- `FP8TRAIN_FUSED_CAST=0` in the server's environment (read at import): nothing compiled, as in the
  ranks;
- a compilation that fails, raises or takes over `LIMIT_S` (an alarm; a hang is a bug) leaves a fresh
  registry of compiled kernels: the ranks compile, or fail and warn, themselves, as before.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings

import torch

import fp8train
from fp8train.numerics import cast

__all__ = ["warm", "LIMIT_S"]

LIMIT_S = 300  # a cold inductor cache builds each kernel with the C++ compiler: seconds each


class _TooLong(Exception):
    pass


def _alarm(signum, frame) -> None:
    raise _TooLong(f"warming the ranks' kernels took over {LIMIT_S} s")


def _train_step(recipe) -> None:
    """One FP8 training step of two 64x64 linear layers (with and without a bias) on a 64x64 batch:
    every cast and GEMM output of at least `cast.FUSED_MIN_ELEMENTS` elements."""
    model = torch.nn.Sequential(fp8train.Linear(64, 64), fp8train.Linear(64, 64, bias=False))
    x = torch.linspace(-2.0, 2.0, 64 * 64).reshape(64, 64)
    with fp8train.fp8_autocast(enabled=True, fp8_recipe=recipe):
        out = model(x)
    out.square().sum().backward()


def _stop_tqdm_monitor() -> None:
    """Stop tqdm's monitor thread if a progress bar started it (a fork starts its own when needed)."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    monitor = getattr(tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm.monitor = None


def warm() -> bool:
    """Compile the kernels of a rank's first FP8 steps in this process (the forkserver); whether they
    were, leaving no thread but this one (False: disabled, failed or too long; then the registry is
    as a fresh process's)."""
    registry = cast.COMPILED_KERNELS
    if not registry.running:
        return False
    from torch._inductor import config as inductor_config

    rng = torch.get_rng_state()
    torch.set_num_threads(1)  # the ranks' (tools/ranks.py): the kernels are specialized on it
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        with warnings.catch_warnings(), inductor_config.patch(compile_threads=1):
            warnings.simplefilter("ignore")
            for recipe in (fp8train.DelayedScaling(), fp8train.Float8CurrentScaling()):
                _train_step(recipe)
        done = registry is cast.COMPILED_KERNELS and registry.failure is None
    except Exception:
        done = False
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_rng_state(rng)
        fp8train.inspection.reset()
        fp8train.reset_reduction_stats()
        _stop_tqdm_monitor()
    if not done:
        cast.COMPILED_KERNELS = cast.CompiledKernels(registry.enabled)
    return done and threading.active_count() == 1


warm()
