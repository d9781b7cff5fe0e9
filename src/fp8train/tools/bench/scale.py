"""Exposed amax-reduction time per optimizer step as ranks grow (`fp8train bench scale`).

On 2, 4 and 8 gloo ranks (one thread each), M microbatches per optimizer step, three modes: blocking
per region (`NVTE_ASYNC_AMAX_REDUCTION=0`), asynchronous per region (the default) and asynchronous
per step (`amax_reduction="step"`). The FP8 work is tiny (two `fp8train.Linear` 16 x 16); the rest of
each microbatch's compute is slept (forward, backward, optimizer), so that 8 ranks on 2 cores measure
waiting and not CPU contention, and:

- every amax collective gets an injected latency counted from the moment the real collective
  completed, i.e. when the last rank joined (`AllReduceSpy(latency_after="completion")`);
- every rank's forward of every microbatch is slowed by a seeded exponential draw (a slowest rank
  per microbatch, drawn anew each time), the compute skew a blocking reduction waits out;
- each step ends with a barrier standing for the data-parallel gradient all-reduce, which every
  loop has once per step whatever the amax mode.

Exposed = time blocked in amax waits (fp8train's own counters), per step, mean over ranks. The
measured overlap windows and skew calibrate the model in scale_model.py, which is checked against
the points it was not calibrated on and then evaluated at 8 to 4,096 GPUs with NCCL's latency.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

import fp8train as ft

from ..ranks import AllReduceSpy, run_ranks
from . import scale_model
from .scale_model import MODES, MeasuredSkew, Workload

LABELS = {"blocking": "blocking per region", "async": "async per region", "async-step": "async per step"}
ENV = "NVTE_ASYNC_AMAX_REDUCTION"


@dataclass(frozen=True)
class Config:
    """One run's settings (seconds). The compute is slept: forward, backward (inside the backward
    pass, before it ends) and the optimizer step."""

    micro: tuple = (1, 4, 16)
    latencies_s: tuple = (0.003, 0.012)
    forward_s: float = 0.008
    backward_s: float = 0.012
    optimizer_s: float = 0.008
    skew_s: float = 0.003  # mean of the exponential extra forward time per rank and microbatch
    steps: int = 6  # measured steps per configuration, in `rounds` interleaved rounds
    rounds: int = 2
    seed: int = 0


# configurations the model is calibrated on; every other measured point is held out
FIT = {"ranks": (2, 8), "micro": 4, "latency_ms": 3.0}


class _SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward (the last node of the pass) sleeps: the backward compute."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(ft.Linear(16, 16), torch.nn.GELU(), ft.Linear(16, 16))


def _skew(cfg: Config, ranks: int, micro: int, latency: float, step: int, m: int, rank: int) -> float:
    """The extra forward time of one rank and microbatch: the same draws in every mode."""
    key = f"{cfg.seed}/{ranks}/{micro}/{latency}/{step}/{m}/{rank}"
    return random.Random(key).expovariate(1.0 / cfg.skew_s) if cfg.skew_s > 0 else 0.0


class _Run:
    """One mode's model and its measurements in one configuration."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.model = _model()
        self.recipe = ft.DelayedScaling(
            amax_history_len=16, amax_reduction="step" if mode == "async-step" else "region"
        )
        self.exposed: list[float] = []  # per step
        self.step_s: list[float] = []
        self.sync_s: list[float] = []  # waiting in the gradient synchronisation (not an amax wait)
        self.windows: dict[str, list[float]] = {
            "fwd_in": [],
            "fwd_across": [],
            "bwd_in": [],
            "bwd_across": [],
        }
        self.compute: list[list[float]] = []  # per step, per microbatch: forward time without waits
        self.launched = 0

    def step(self, cfg: Config, world: int, rank: int, micro: int, latency: float, step: int, keep: bool):
        os.environ[ENV] = "0" if self.mode == "blocking" else "1"
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        start = time.perf_counter()
        before = ft.inspection.counters()
        compute = []
        for m in range(micro):
            where = "in" if m else "across"
            with ft.fp8_autocast(fp8_recipe=self.recipe):
                c0 = ft.inspection.counters()
                t0 = time.perf_counter()
                y = self.model(_SleepInBackward.apply(x, cfg.backward_s))  # waits for region m-1's fwd
                c1 = ft.inspection.counters()
                time.sleep(cfg.forward_s + _skew(cfg, world, micro, latency, step, m, rank))
                compute.append(time.perf_counter() - t0 - (c1["exposed_wait_s"] - c0["exposed_wait_s"]))
            c2 = ft.inspection.counters()
            y.square().mean().backward()  # its first FP8 node waits for pass m-1's bwd
            c3 = ft.inspection.counters()
            if keep and self.mode != "blocking":
                self._window(f"fwd_{where}", c0, c1)
                self._window(f"bwd_{where}", c2, c3)
        s0 = time.perf_counter()
        dist.barrier()  # the gradient all-reduce every data-parallel step has
        sync = time.perf_counter() - s0
        if self.mode == "async-step":
            ft.end_step()
        time.sleep(cfg.optimizer_s)
        after = ft.inspection.counters()
        if keep:
            self.exposed.append(after["exposed_wait_s"] - before["exposed_wait_s"])
            self.step_s.append(time.perf_counter() - start)
            self.sync_s.append(sync)
            self.compute.append(compute)
            self.launched += after["launched"] - before["launched"]

    def _window(self, name: str, before: dict, after: dict) -> None:
        if after["hidden_s"] > before["hidden_s"]:  # a wait on a collective launched earlier began
            self.windows[name].append(after["hidden_s"] - before["hidden_s"])

    def summary(self) -> dict:
        return {
            "exposed_s_per_step": statistics.fmean(self.exposed),
            "step_s": statistics.median(self.step_s),
            "sync_s_per_step": statistics.fmean(self.sync_s),
            "launched_per_step": self.launched / len(self.exposed),
            "windows_s": {k: statistics.fmean(v) if v else None for k, v in self.windows.items()},
            "compute_s": self.compute,
        }


def _raw_collective_s(cfg: Config, repeats: int = 30) -> float:
    """Mean time of a plain blocking gloo all-reduce of about the amax wire's size (4,160 floats; the
    wire is 4,096 amaxes and an 18-value header), the ranks arriving together after a forward's
    sleep: what one collective costs on this machine before any injected latency (it grows with the
    ranks sharing 2 cores)."""
    buffer = torch.zeros(4096 + 64)
    times = []
    for i in range(repeats):
        if i % 10 == 0:
            dist.barrier()
        time.sleep(cfg.forward_s)
        start = time.perf_counter()
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
        times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def _rank(rank: int, world: int, cfg: Config) -> dict:
    torch.set_num_threads(1)
    results = {"raw_collective_s": _raw_collective_s(cfg)}
    for latency in cfg.latencies_s:
        spy = AllReduceSpy(latency_s=latency, latency_after="completion")
        spy.install()
        for micro in cfg.micro:
            ft.inspection.reset()
            runs = {mode: _Run(mode) for mode in MODES}
            per_round = max(1, cfg.steps // cfg.rounds)
            step = 0
            for round_ in range(cfg.rounds + 1):  # round 0 warms up (and settles the layout)
                for run in runs.values():
                    # the first step of a block is not kept: it has no earlier step to wait for, and
                    # each kept step then counts one step boundary's waits, as in a steady loop
                    for i in range(1 + (per_round if round_ else 0)):
                        run.step(cfg, world, rank, micro, latency, step + i, keep=round_ > 0 and i > 0)
                    ft.synchronize()  # the next mode's block starts with nothing in flight
                step += 1 + (per_round if round_ else 0)
            results[(latency, micro)] = {mode: run.summary() for mode, run in runs.items()}
        spy.uninstall()
        dist.barrier()
    os.environ.pop(ENV, None)
    return results


def measure(ranks=(2, 4, 8), cfg: Config = Config()) -> list[dict]:
    """One row per (ranks, latency, M, mode): exposed ms per step (mean and max over ranks), step
    time, the measured overlap windows and each rank's forward compute times."""
    rows = []
    for world in ranks:
        by_rank = run_ranks(_rank, world, cfg, timeout_s=1800, pg_timeout_s=300)
        for latency in cfg.latencies_s:
            for micro in cfg.micro:
                for mode in MODES:
                    per = [r[(latency, micro)][mode] for r in by_rank]
                    exposed = [p["exposed_s_per_step"] for p in per]
                    windows = {k: _mean([p["windows_s"][k] for p in per]) for k in per[0]["windows_s"]}
                    rows.append(
                        {
                            "ranks": world,
                            "latency_ms": 1e3 * latency,
                            "M": micro,
                            "mode": mode,
                            "exposed_ms": 1e3 * statistics.fmean(exposed),
                            "exposed_ms_max_rank": 1e3 * max(exposed),
                            "step_ms": 1e3 * statistics.fmean(p["step_s"] for p in per),
                            "sync_ms": 1e3 * statistics.fmean(p["sync_s_per_step"] for p in per),
                            "collectives_per_step": per[0]["launched_per_step"],
                            "raw_collective_ms": 1e3
                            * statistics.fmean(r["raw_collective_s"] for r in by_rank),
                            "windows_ms": {k: None if v is None else 1e3 * v for k, v in windows.items()},
                            "gap_ms": 1e3 * _measured_gap([p["compute_s"] for p in per]),
                            "compute_s": [p["compute_s"] for p in per],
                        }
                    )
    return rows


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _measured_gap(compute: list) -> float:
    """Mean over regions and ranks of (slowest rank's forward time - own): the measured Delta_N."""
    gaps = []
    for step in range(len(compute[0])):
        for m in range(len(compute[0][step])):
            times = [rank[step][m] for rank in compute]
            gaps += [max(times) - t for t in times]
    return statistics.fmean(gaps)


# ---- calibration, held-out check, extrapolation ----------------------------------------------------
def is_fit_point(row: dict, fit: dict = FIT) -> bool:
    return (
        row["ranks"] in fit["ranks"] and row["M"] == fit["micro"] and row["latency_ms"] == fit["latency_ms"]
    )


def skew_of(rows: list[dict]) -> MeasuredSkew:
    """The skew, measured: the distribution of the rows' forward times per rank and microbatch (an
    empirical body and an exponential tail; only its spread matters, the gaps between ranks)."""
    return MeasuredSkew([t for r in rows for rank in r["compute_s"] for step in rank for t in step])


def describe(skew: MeasuredSkew) -> dict:
    q = skew.quantile(torch.tensor([0.5], dtype=torch.float64))
    return {"median_ms": 1e3 * float(q[0]), "p90_ms": 1e3 * skew.u, "tail_scale_ms": 1e3 * skew.tail}


def _windows(row: dict) -> tuple:
    keys = ("fwd_in", "fwd_across", "bwd_in", "bwd_across")
    return tuple(1e-3 * (row["windows_ms"][k] or 0.0) for k in keys)


def calibrate(rows: list[dict], fit_points: dict = FIT) -> dict:
    """The model's fitted quantities, from the calibration points' blocking exposure only: what a
    collective costs beyond its injected latency, overhead(N) = a + b g(N), with g(N) the measured
    cost of a plain gloo all-reduce on N ranks (raw_collective_ms: on this box, gloo's sequential
    hops, each a wake-up of a process sharing 2 cores) and a the per-collective work of fp8train's
    blocking path. Two calibration rank counts fix a and b; the overhead enters the blocking exposure
    linearly: per region, E[Delta_N] + 2 (latency + overhead)."""
    fit = [r for r in rows if is_fit_point(r, fit_points) and r["mode"] == "blocking"]
    if len({r["ranks"] for r in fit}) < 2:
        raise ValueError("calibration needs blocking points at two rank counts")
    points = []
    for r in fit:
        skew = skew_of([q for q in rows if q["ranks"] == r["ranks"]])
        per_region = 1e-3 * r["exposed_ms"] / r["M"]
        overhead = (per_region - scale_model.expected_gap(r["ranks"], skew)) / 2 - 1e-3 * r["latency_ms"]
        points.append((1e-3 * r["raw_collective_ms"], overhead))
    (x0, y0), (x1, y1) = min(points), max(points)
    b = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return {"overhead_a_s": y0 - b * x0, "overhead_b": b}


def workload_for(row: dict, rows: list[dict], fitted: dict) -> Workload:
    """The model's inputs at one measured point: the fitted overhead at its rank count, the skew
    measured at its rank count (all its configurations' forward times: an input, not its exposure),
    the overlap windows measured at that point and the microbatch period they imply."""
    overhead = fitted["overhead_a_s"] + fitted["overhead_b"] * 1e-3 * row["raw_collective_ms"]
    same = [
        r
        for r in rows
        if r["ranks"] == row["ranks"] and r["M"] == row["M"] and r["latency_ms"] == row["latency_ms"]
    ]
    windows = {r["mode"]: _windows(r) for r in same if r["mode"] != "blocking"}
    samples = [r for r in rows if r["ranks"] == row["ranks"]]
    skew = skew_of(samples)
    # a microbatch without waits, measured where the loop has none within a step (per-step mode)
    step = next((r for r in same if r["mode"] == "async-step"), None)
    period = math.inf
    if step is not None:
        busy = step["step_ms"] - step["sync_ms"] - step["exposed_ms"]  # and the optimizer step, 1/M of it
        period = 1e-3 * busy / row["M"]
    return Workload(skew=skew, overhead_s=max(0.0, overhead), windows=windows, period_s=period)


def check(rows: list[dict], fitted: dict, fit_points: dict = FIT) -> list[dict]:
    """Measured against modelled, every point, with whether it was a calibration point."""
    out = []
    for r in rows:
        w = workload_for(r, rows, fitted)
        model = 1e3 * scale_model.exposed_per_step(r["mode"], r["M"], r["ranks"], 1e-3 * r["latency_ms"], w)
        out.append(
            {
                "ranks": r["ranks"],
                "latency_ms": r["latency_ms"],
                "M": r["M"],
                "mode": r["mode"],
                "measured_ms": r["exposed_ms"],
                "model_ms": model,
                "rel_error": (model - r["exposed_ms"]) / r["exposed_ms"] if r["exposed_ms"] > 0 else None,
                "fitted": is_fit_point(r, fit_points),
                "overhead_ms": 1e3 * w.overhead_s,
            }
        )
    return out


def gpu_workload(rows: list[dict]) -> Workload:
    """For the GPU curve: the skew measured over every run (all rank counts pooled: this workload's
    forward times with this machine's noise), the windows measured at the smallest rank count and
    latency, no CPU overhead (NCCL's figure is the whole collective)."""
    ranks, latency = min(r["ranks"] for r in rows), min(r["latency_ms"] for r in rows)
    base = [r for r in rows if r["ranks"] == ranks and r["latency_ms"] == latency and r["M"] > 1]
    windows = {}
    for mode in ("async", "async-step"):
        mine = [_windows(r) for r in base if r["mode"] == mode]
        windows[mode] = tuple(statistics.fmean(w[i] for w in mine) for i in range(4))
    return Workload(skew=skew_of(rows), overhead_s=0.0, windows=windows)


def extrapolate(gpu: Workload, gpus=tuple(2**k for k in range(3, 13)), micro=(1, 4, 16)) -> list[dict]:
    """The modelled curve with NCCL's latency at each GPU count."""
    return [
        {
            "gpus": n,
            "latency_us": 1e6 * scale_model.nccl_latency_s(n),
            "M": m,
            "mode": mode,
            "model_ms": 1e3 * scale_model.exposed_per_step(mode, m, n, scale_model.nccl_latency_s(n), gpu),
        }
        for n in gpus
        for m in micro
        for mode in MODES
    ]


def plot(checked: list[dict], curve: list[dict], path: str) -> str:
    """Left: measured (markers) and modelled (thin lines) exposed time per step against ranks at the
    smallest injected latency; right: the model with NCCL's latency, 8 to 4,096 GPUs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    micro = sorted({r["M"] for r in curve})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), dpi=80)
    colors = {"blocking": "tab:red", "async": "tab:blue", "async-step": "tab:green"}
    styles = dict(zip(micro, ("-", "--", ":")))
    latency = min(r["latency_ms"] for r in checked)
    for mode in MODES:
        for m in micro:
            mine = sorted((r["ranks"], r["measured_ms"], r["model_ms"]) for r in checked
                          if r["mode"] == mode and r["M"] == m and r["latency_ms"] == latency)  # fmt: skip
            if mine:
                n, measured, model = zip(*mine)
                axes[0].plot(n, measured, marker="o", ls="none", color=colors[mode])
                axes[0].plot(n, model, lw=1, ls=styles[m], color=colors[mode])
            line = sorted((r["gpus"], r["model_ms"]) for r in curve if r["mode"] == mode and r["M"] == m)
            axes[1].plot(*zip(*line), color=colors[mode], ls=styles[m], label=f"{LABELS[mode]}, M={m}")
    axes[0].set_title(f"gloo, 2 cores: measured (dots), model (lines); {latency:g} ms latency", fontsize=9)
    axes[0].set_xlabel("ranks")
    axes[0].set_xticks([2, 4, 8])
    axes[1].set_title("model: NCCL latency 15-105 us, the measured skew and windows", fontsize=9)
    axes[1].set_xlabel("GPUs")
    axes[1].set_xscale("log", base=2)
    for ax in axes:
        ax.set_ylabel("exposed amax wait per optimizer step (ms)")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def run(
    ranks=(2, 4, 8), cfg: Config = Config(), fit_points: dict = FIT, plot_path: str | None = None
) -> dict:
    return analyse(measure(ranks, cfg), cfg, fit_points, plot_path)


def analyse(rows: list[dict], cfg: Config, fit_points: dict = FIT, plot_path: str | None = None) -> dict:
    """Calibrate on `fit_points`, check every measured point, extend to GPUs, plot; the JSON's body."""
    ranks = sorted({r["ranks"] for r in rows})
    fitted = calibrate(rows, fit_points)
    checked = check(rows, fitted, fit_points)
    gpu = gpu_workload(rows)
    curve = extrapolate(gpu)
    if plot_path:
        plot(checked, curve, plot_path)
    table = [{k: v for k, v in r.items() if k not in ("compute_s", "windows_ms")} for r in rows]
    return {
        "config": asdict(cfg),
        "fit_points": fit_points,
        "fitted": {"overhead_a_ms": 1e3 * fitted["overhead_a_s"], "overhead_b": fitted["overhead_b"]},
        "raw_collective_ms_by_ranks": {
            n: next(r["raw_collective_ms"] for r in rows if r["ranks"] == n) for n in ranks
        },
        "gpu_workload": {
            "skew": describe(gpu.skew),
            "windows_ms": {k: [1e3 * v for v in w] for k, w in gpu.windows.items()},
        },
        "skew_by_ranks": {n: describe(skew_of([r for r in rows if r["ranks"] == n])) for n in ranks},
        "rows": table,
        "measured": rows,
        "model_check": checked,
        "model_curve": curve,
        "plot": plot_path,
    }


# the keys of measure()'s rows, which analyse() reads back from a saved run
MEASURED_FIELDS = (
    "ranks", "latency_ms", "M", "mode", "exposed_ms", "exposed_ms_max_rank", "step_ms", "sync_ms",
    "collectives_per_step", "raw_collective_ms", "windows_ms", "gap_ms", "compute_s",
)  # fmt: skip


def saved_run_problem(saved) -> str | None:
    """What keeps `saved` (a loaded scale.json) from being analysed again, or None."""
    if not isinstance(saved, dict):
        return "not a JSON object"
    config, fit, rows = saved.get("config"), saved.get("fit_points"), saved.get("measured")
    known = {f.name for f in fields(Config)}
    if not isinstance(config, dict) or not set(config) <= known:
        return f'"config" is not an object of {sorted(known)}'
    if not isinstance(fit, dict) or not {"ranks", "micro", "latency_ms"} <= set(fit):
        return '"fit_points" is not an object with "ranks", "micro" and "latency_ms"'
    if not (isinstance(fit["ranks"], list) and len(fit["ranks"]) == 2):
        return '"fit_points" "ranks" is not two rank counts'
    if not isinstance(rows, list) or not rows:
        return '"measured" is not a list of measurements'
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not set(MEASURED_FIELDS) <= set(row):
            return f'"measured"[{i}] is not an object with {", ".join(MEASURED_FIELDS)}'
    environment = saved.get("environment")
    if "measured_at" not in saved and not (isinstance(environment, dict) and "when" in environment):
        return 'neither "measured_at" nor "environment" "when"'
    return None


def report(result: dict) -> str:
    """The model's inputs, measured vs modelled on every point (held-out ones marked), the curve."""
    from .common import table

    f, g = result["fitted"], result["gpu_workload"]
    raw = ", ".join(f"{n}: {v:.2f}" for n, v in result["raw_collective_ms_by_ranks"].items())
    skews = "; ".join(
        f"{n}: " + ", ".join(f"{v:.2f}" for v in d.values()) for n, d in result["skew_by_ranks"].items()
    )
    lines = [
        f"fitted on {result['fit_points']} (blocking): overhead per collective = "
        f"{f['overhead_a_ms']:.3f} ms + {f['overhead_b']:.3f} x the raw gloo all-reduce ({raw} ms)",
        f"measured forward times by ranks (median, p90, tail scale), ms: {skews}",
        f"GPU curve inputs: skew {g['skew']}, windows ms (fwd in, fwd across, bwd in, bwd across) "
        + str({k: [round(v, 2) for v in w] for k, w in g["windows_ms"].items()}),
        "",
        "measured vs model (exposed ms per step; held out = not a calibration point):",
        table(
            [{**r, "point": "fitted" if r["fitted"] else "held out"} for r in result["model_check"]],
            ["ranks", "latency_ms", "M", "mode", "measured_ms", "model_ms", "rel_error", "point"],
        ),
        "",
        "model, GPUs (NCCL latency, no CPU overhead; exposed ms per step):",
    ]
    curve = result["model_curve"]
    micro = sorted({r["M"] for r in curve})
    rows = []
    for n in sorted({r["gpus"] for r in curve}):
        row = {"gpus": n, "latency_us": next(r["latency_us"] for r in curve if r["gpus"] == n)}
        for r in curve:
            if r["gpus"] == n:
                row[f"{r['mode']} M={r['M']}"] = r["model_ms"]
        rows.append(row)
    lines.append(table(rows, ["gpus", "latency_us"] + [f"{mode} M={m}" for mode in MODES for m in micro]))
    return "\n".join(lines)
