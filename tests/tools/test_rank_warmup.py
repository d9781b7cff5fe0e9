"""The forkserver that `run_ranks` forks ranks from compiles fp8train's CPU kernels once
(fp8train.tools.rank_warmup): each rank starts with exactly the kernels it would have compiled itself,
and with nothing else of the warm-up (no fp8train state, the random generator untouched); a warm-up
that fails or hangs leaves the ranks a fresh registry, as if none had run."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fp8train
from fp8train.numerics import cast
from multirank import run_ranks

pytestmark = pytest.mark.multirank


def _generated_code(kernel) -> str:
    """The file inductor wrote the kernel's generated code to, named by a hash of that code (its C++
    included): equal names, the same kernel. Reached through the direct call's graph (private)."""
    return kernel.graph.__globals__["graph"].current_callable.__code__.co_filename.rsplit("/", 1)[-1]


def _kernels(registry) -> dict[str, str]:
    return {kernel.__name__ + str(key): _generated_code(k) for (kernel, key), k in registry.compiled.items()}


def _step(recipe) -> list[torch.Tensor]:
    """A training step of another shape than the warm-up's: the loss, the input's and weights' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(fp8train.Linear(96, 160), fp8train.Linear(160, 96, bias=False))
    x = torch.randn(48, 96, requires_grad=True)
    with fp8train.fp8_autocast(enabled=True, fp8_recipe=recipe):
        loss = model(x).square().mean()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


def _inherited_and_own(rank: int, world: int) -> dict:
    seed = torch.Generator()
    seed.manual_seed(torch.initial_seed())
    out = {
        "rng_untouched": torch.equal(torch.get_rng_state(), seed.get_state()),
        "amax_groups": len(fp8train.inspection.amax_groups()),
        "inherited": _kernels(cast.COMPILED_KERNELS),
        "direct": all(k.graph is not None for k in cast.COMPILED_KERNELS.compiled.values()),
    }
    recipes = (fp8train.DelayedScaling(), fp8train.Float8CurrentScaling())
    start = time.perf_counter()
    out["warm_steps"] = [_step(recipe) for recipe in recipes]
    out["warm_s"] = time.perf_counter() - start
    out["after_warm_steps"] = _kernels(cast.COMPILED_KERNELS)
    cast.COMPILED_KERNELS = cast.CompiledKernels(True)  # what a rank compiles itself
    out["own_steps"] = [_step(recipe) for recipe in recipes]
    out["own"] = _kernels(cast.COMPILED_KERNELS)
    return out


def test_ranks_start_with_the_kernels_they_would_compile_and_nothing_else() -> None:
    for out in run_ranks(_inherited_and_own, 2, timeout_s=300):
        assert out["rng_untouched"] and out["amax_groups"] == 0
        inherited, own = out["inherited"], out["own"]
        assert out["direct"] and len(inherited) >= 5, inherited  # 3 casts and 2 outputs at least
        assert own and all(inherited.get(name) == code for name, code in own.items()), (inherited, own)
        assert out["after_warm_steps"] == inherited  # the steps compiled nothing more
        for warm_step, own_step in zip(out["warm_steps"], out["own_steps"]):
            assert all(torch.equal(a, b) for a, b in zip(warm_step, own_step))
    # (the figure that motivates it: about 7 s for the first of these steps of a fresh rank)
    print(f"the first FP8 steps of a warmed rank: {out['warm_s']:.2f} s")


def _failing_warmups(rank: int, world: int) -> dict:
    from fp8train.tools import rank_warmup
    from fp8train.torch_internals import DirectlyCalled

    out = {}
    cast.COMPILED_KERNELS = cast.CompiledKernels(True)
    out["warmed"] = rank_warmup.warm(), threading.active_count(), len(cast.COMPILED_KERNELS.compiled)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    real_backend = DirectlyCalled._backend
    DirectlyCalled._backend = broken
    try:
        failing = cast.COMPILED_KERNELS = cast.CompiledKernels(True)
        done = rank_warmup.warm()
        fresh = cast.COMPILED_KERNELS
        out["failed"] = done, failing.failure is not None, fresh is not failing, fresh.running, fresh.compiled
    finally:
        DirectlyCalled._backend = real_backend

    real_step, rank_warmup._train_step = rank_warmup._train_step, lambda recipe: time.sleep(30)
    rank_warmup.LIMIT_S = 1
    try:
        hanging = cast.COMPILED_KERNELS = cast.CompiledKernels(True)
        start = time.perf_counter()
        done = rank_warmup.warm()
        out["hung"] = done, time.perf_counter() - start, cast.COMPILED_KERNELS is not hanging
    finally:
        rank_warmup._train_step = real_step

    off = cast.COMPILED_KERNELS = cast.CompiledKernels(False)  # FP8TRAIN_FUSED_CAST=0
    out["off"] = rank_warmup.warm(), cast.COMPILED_KERNELS is off, off.compiled
    return out


def test_a_warmup_that_fails_or_hangs_leaves_a_fresh_registry() -> None:
    (out,) = run_ranks(_failing_warmups, 1, timeout_s=300)
    assert out["warmed"][0] and out["warmed"][1] == 1 and out["warmed"][2] >= 5  # one thread left
    assert out["failed"] == (False, True, True, True, {})
    done, took, replaced = out["hung"]
    assert not done and took < 10 and replaced
    assert out["off"] == (False, True, {})
