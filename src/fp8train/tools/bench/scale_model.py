"""A model of the amax reduction's exposed time per optimizer step, as ranks grow (docs/benchmarks.md).

Pure arithmetic (the standard library, and torch for the measured distribution's integrals), so that
it can be unit-tested and evaluated at 4,096 GPUs. `fp8train bench scale` (scale.py) measures the
inputs on up to 8 gloo ranks and checks the model against the measured points it was not
calibrated on.

Assumptions, stated once here and in docs/benchmarks.md:

- Latency per collective on GPUs: NCCL's tuner figures for a small all-reduce with the tree
  algorithm at 8 GPUs per node, about 15 us on 8 GPUs (one node) and 105 us on 4,096, linear in
  log N between them (a tree's depth grows with log N); below 8 GPUs the 8-GPU figure.
- Skew: each rank's compute time per microbatch region is an independent draw, across ranks and
  regions, from one distribution: the measured one (`MeasuredSkew`: the measured forward times,
  with an exponential tail fitted above their 90th percentile so that the max of 4,096 draws is
  defined), or an exponential of mean `skew` seconds (a float). A rank of a blocking reduction
  waits for the slowest of N ranks at every region; the gap between the slowest and a given rank
  is Delta_N = max(D_1..D_N) - D_own.
- Overlap windows (launch to first use) are properties of the workload, measured, and do not
  change with N. One synchronisation per optimizer step already exists (the data-parallel gradient
  all-reduce), so the per-step reduction and the reductions across a step boundary start with the
  ranks aligned: skew never reaches them.
- `overhead_s`: what a collective costs beyond its latency (fitted: on the CPU box, gloo and Python
  per wait; 0 for the GPU extrapolation, where NCCL's figure is the whole collective).
- The collectives of one process group run one at a time, in launch order (gloo's work queue, one
  NCCL communicator's stream): a collective launched behind another completes its cost c after
  that one, and when a microbatch's two collectives need more channel time than the microbatch
  takes (2c > its period), the asynchronous loop is throughput-bound and waits the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import torch

__all__ = [
    "MODES",
    "NCCL_SMALL_ALLREDUCE",
    "Workload",
    "MeasuredSkew",
    "nccl_latency_s",
    "gap_cdf",
    "expected_gap",
    "expected_excess",
    "exposed_per_step",
]

MODES = ("blocking", "async", "async-step")  # per region blocking, per region async, per step async
NCCL_SMALL_ALLREDUCE = ((8, 15e-6), (4096, 105e-6))  # (GPUs, seconds): tree, 8 GPUs per node


def nccl_latency_s(ranks: int) -> float:
    """A small all-reduce's latency on `ranks` GPUs, interpolated in log N between NCCL's tuner
    figures (held at the 8-GPU figure below 8, extrapolated in log N above 4,096)."""
    (n0, l0), (n1, l1) = NCCL_SMALL_ALLREDUCE
    if ranks <= n0:
        return l0
    return l0 + (l1 - l0) * math.log(ranks / n0) / math.log(n1 / n0)


def gap_cdf(t: float, ranks: int, skew_s: float) -> float:
    """P(Delta_N <= t) for i.i.d. exponential draws of mean `skew_s`.

    Delta_N = max(0, M_{N-1} - D) with D the own draw and M_{N-1} the max of the other N - 1;
    P(M_{N-1} <= D + t) = E_D[(1 - q e^{-D/mu})^{N-1}], q = e^{-t/mu}, and with u = e^{-D/mu}
    (uniform on [0, 1]) that integral is (1 - (1 - q)^N) / (N q). At t = 0 it is 1/N: the chance
    that this rank is itself the slowest."""
    if t < 0:
        return 0.0
    if ranks == 1 or skew_s == 0:
        return 1.0
    q = math.exp(-t / skew_s)
    if q == 0.0:  # underflow: far in the tail
        return 1.0
    return -math.expm1(ranks * math.log1p(-q)) / (ranks * q) if q < 1 else 1.0 / ranks


class MeasuredSkew:
    """The measured distribution of a rank's compute time per region: the samples' empirical CDF up
    to their 90th percentile u, above it an exponential tail fitted to the excesses over u (peaks
    over threshold; scale = median excess / ln 2), so that the max of many more draws than samples
    is defined."""

    QUANTILES = 200  # the own draw D is integrated over this many quantiles

    def __init__(self, samples: list) -> None:
        if len(samples) < 20:
            raise ValueError("MeasuredSkew needs at least 20 samples")
        self.sorted = torch.tensor(sorted(samples), dtype=torch.float64)
        k = len(samples)
        self.u = float(self.sorted[int(0.9 * (k - 1))])
        excess = self.sorted[self.sorted > self.u] - self.u
        # the exponential's scale from the median excess (median = scale x ln 2): a few stalls of the
        # machine, hundreds of ms each, would dominate the mean excess and the max of 4,096 draws
        self.tail = max(float(excess.median()) / math.log(2), 1e-9) if len(excess) else 1e-9
        self.tail_p = len(excess) / k
        p = (torch.arange(self.QUANTILES, dtype=torch.float64) + 0.5) / self.QUANTILES
        self.grid = self.quantile(p)

    def cdf(self, x: torch.Tensor) -> torch.Tensor:
        body = torch.searchsorted(self.sorted, x, right=True).double() / len(self.sorted)
        tail = 1.0 - self.tail_p * torch.exp(-(x - self.u) / self.tail)
        return torch.where(x > self.u, tail, body)

    def quantile(self, p: torch.Tensor) -> torch.Tensor:
        index = (p * len(self.sorted)).long().clamp(max=len(self.sorted) - 1)
        tail = self.u - self.tail * torch.log((1.0 - p).clamp(min=1e-300) / self.tail_p)
        return torch.where(p > 1.0 - self.tail_p, tail, self.sorted[index])

    def scale(self) -> float:
        """A length for integration spans: the spread of the body plus the tail's scale."""
        return self.u - float(self.sorted[0]) + self.tail

    def gap_survival(self, t: torch.Tensor, ranks: int) -> torch.Tensor:
        """P(Delta_N > t) for each t >= 0: 1 - E_D[F(D + t)^(N - 1)] (the other N - 1 draws below D + t)."""
        f = self.cdf(t[:, None] + self.grid[None, :])
        return 1.0 - (f ** (ranks - 1)).mean(dim=1)


Skew = Union[float, MeasuredSkew]


def _scale(skew: Skew) -> float:
    return skew.scale() if isinstance(skew, MeasuredSkew) else skew


def expected_gap(ranks: int, skew: Skew) -> float:
    """E[Delta_N]. Exponential of mean mu: mu (H_N - 1) (E[max of N] = mu H_N, Renyi, minus the own
    mean mu); measured: the integral of P(Delta_N > t)."""
    if isinstance(skew, MeasuredSkew):
        return expected_excess(0.0, ranks, skew)
    return skew * (sum(1.0 / k for k in range(1, ranks + 1)) - 1.0)


def expected_excess(a: float, ranks: int, skew: Skew, steps: int = 4000) -> float:
    """E[max(0, a + Delta_N)]: what a wait exposes when the collective is ready `a` after the wait
    starts if all ranks had arrived together (a = latency - window), and the slowest rank arrives
    Delta_N later. = max(a, 0) + integral over t >= max(0, -a) of P(Delta_N > t) (trapezoid)."""
    scale = _scale(skew)
    if ranks == 1 or scale == 0:
        return max(a, 0.0)
    start = max(0.0, -a)
    span = 40.0 * scale + 2.0 * scale * math.log(ranks)  # P(Delta > start + span) is negligible
    if isinstance(skew, MeasuredSkew):
        steps = min(steps, 1500)  # each point also integrates over the own draw
    h = span / steps
    if isinstance(skew, MeasuredSkew):
        values = skew.gap_survival(start + h * torch.arange(steps + 1, dtype=torch.float64), ranks).tolist()
    else:
        values = [1.0 - gap_cdf(start + i * h, ranks, skew) for i in range(steps + 1)]
    return max(a, 0.0) + h * (sum(values) - 0.5 * (values[0] + values[-1]))


@dataclass(frozen=True)
class Workload:
    """What the model needs besides the mode, M, N and the latency (measured or fitted).

    windows[mode] = (fwd within a step, fwd across the step boundary, bwd within, bwd across):
    the time from a launch to its first use. Per-step mode uses only the across-boundary ones."""

    skew: Skew
    overhead_s: float = 0.0
    windows: dict = field(default_factory=dict)
    period_s: float = math.inf  # a microbatch's duration in the loop without waits (async per region)


def exposed_per_step(mode: str, micro: int, ranks: int, latency_s: float, w: Workload) -> float:
    """Seconds per optimizer step that a rank (mean over ranks) stands blocked on amax reductions.

    - blocking (per region): 2M collectives each exposing its whole cost c = latency + overhead,
      and each forward one also the wait for the slowest rank's region: M (E[Delta_N] + c) + M c.
      (The forward wait aligns the ranks, so the backward collective that follows finds them
      together.)
    - async (per region): a collective exposes only what its window W does not hide. Within a step
      the forward collective of region m is first needed at region m + 1, and the slowest rank
      launched it Delta_N late: E[max(0, c + Delta_N - W_f)] + max(0, c - W_b) per microbatch after
      the first, unless the channel is the bottleneck: then max(0, 2c - period) per microbatch (the
      larger of the two). Across the step boundary (the ranks aligned by the gradient
      synchronisation): max(0, c - W) for each direction.
    - async-step (per step): 2 collectives launched back to back once per step after the gradient
      synchronisation, the backward one behind the forward one: max(0, c - W_fwd) +
      max(0, 2c - W_bwd), whatever M.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    c = latency_s + w.overhead_s
    if mode == "blocking":
        return micro * (expected_gap(ranks, w.skew) + c) + micro * c
    fwd_in, fwd_across, bwd_in, bwd_across = w.windows[mode]
    if mode == "async-step":
        return max(0.0, c - fwd_across) + max(0.0, 2 * c - bwd_across)
    hidden_by_windows = expected_excess(c - fwd_in, ranks, w.skew) + max(0.0, c - bwd_in)
    throughput = max(0.0, 2 * c - w.period_s)
    within = (micro - 1) * max(hidden_by_windows, throughput)
    return within + max(0.0, c - fwd_across) + max(0.0, c - bwd_across)
