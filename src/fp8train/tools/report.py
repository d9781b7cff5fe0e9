"""`fp8train report RUN_DIR`: a PNG and a Markdown summary from a run's metrics.jsonl.

Works on any directory written by `fp8train.telemetry.Telemetry` (the demo adds run metadata and
per-run totals, which the report uses when present). matplotlib runs with the Agg backend.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import textwrap
from typing import Optional

from fp8train.telemetry import METRICS_FILE, read_metrics

from .quant_error import ROLES
from .report_coverage import coverage_section

__all__ = ["load_run", "render", "RunData"]

_LAYER = re.compile(r"^(?:.*\.)?(?:blocks|layers|h)\.(\d+)\.")
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "x")
ROLE_TEXT = {"input": "GEMM input", "weight": "weight", "grad_output": "output gradient"}


class RunData:
    """The records of one run (e.g. "fp8-async", "reference") of a run directory."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.meta: dict = {}
        self.end: Optional[dict] = None
        self.steps: list[dict] = []
        self.quant_errors: list[dict] = []  # the demo's "quant_error" records

    @property
    def fp8(self) -> bool:
        if "fp8" in self.meta:
            return bool(self.meta["fp8"])
        return any(r["roles"] or r.get("recipe") for r in self.steps)

    @property
    def recipe_kind(self) -> Optional[str]:
        """The FP8 recipe kind ("delayed", "current", "block"): from the demo's metadata, else from
        the step records (runs logged before recipes were recorded: delayed), None for no FP8."""
        if self.meta.get("recipe_kind"):
            return self.meta["recipe_kind"]
        kinds = [r["recipe"] for r in self.steps if r.get("recipe")]
        return kinds[-1] if kinds else ("delayed" if self.fp8 else None)

    def median_step_ms(self) -> Optional[float]:
        if self.end is not None and "median_step_s" in self.end:
            return 1e3 * self.end["median_step_s"]
        times = [r["step_s"] for r in self.steps if _is_finite(r.get("step_s"))]
        return 1e3 * statistics.median(times) if times else None

    def losses(self) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r["loss"]) for r in self.steps if isinstance(r.get("loss"), (int, float))]
        return [s for s, _ in pts], [v for _, v in pts]

    def final_loss(self) -> Optional[float]:
        if self.end is not None:
            return self.end["final_loss"]
        _, losses = self.losses()
        if not losses:
            return None
        tail = max(1, len(losses) // 10)
        return sum(losses[-tail:]) / tail

    def reduction(self) -> list[dict]:
        """Final reduction statistics per rank (rank 0 only when the run has no end record)."""
        if self.end is not None and self.end.get("reduction_per_rank"):
            return self.end["reduction_per_rank"]
        return [self.steps[-1]["reduction"]] if self.steps else []

    def role_series(self, key: str) -> dict[str, tuple[list[int], list[float]]]:
        out: dict[str, tuple[list[int], list[float]]] = {}
        for r in self.steps:
            for name, values in r["roles"].items():
                xs, ys = out.setdefault(name, ([], []))
                xs.append(r["step"])
                ys.append(values[key])
        return out

    def quant_error_series(self, role: str) -> tuple[list[int], list[float]]:
        """(steps, relative error of `role` averaged over the sampled GEMMs) of the measured steps."""
        xs, ys = [], []
        for rec in self.quant_errors:
            values = [r[role] for r in rec["rel_error"].values() if _is_finite(r.get(role))]
            if values:
                xs.append(rec["step"])
                ys.append(statistics.fmean(values))
        return xs, ys

    def clipping(self) -> dict:
        """Delayed scaling's clipped casts: of the role-steps logged, those whose utilisation
        (amax x scale used / fp8_max) exceeded 1, where the cast saturated and the largest value lost
        the share 1 - 1/utilisation of itself (1.05: 4.8%); their largest and median share."""
        shares = [clipped_share(v["util"]) for r in self.steps for v in r["roles"].values()]
        clipped = [c for c in shares if c > 0]
        return {
            "role_steps": len(shares),
            "clipped": len(clipped),
            "max_share": max(clipped, default=0.0),
            "median_share": statistics.median(clipped) if clipped else 0.0,
        }

    def events(self) -> dict:
        total = {"overflow": 0, "nonfinite": 0}
        for r in self.steps:
            for k in total:
                total[k] += r["events"][k]
        return total


def load_run(run_dir: str) -> dict[str, RunData]:
    """Group the records of run_dir/metrics.jsonl by run name, in order of appearance. A line the
    report cannot read is a ValueError naming the file, the line and what is wrong."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: RUN_DIR must hold a {METRICS_FILE} written by fp8train"
        )
    runs: dict[str, RunData] = {}
    for rec in _checked_records(path):
        name = rec.get("run", "fp8")
        run = runs.setdefault(name, RunData(name))
        kind = rec.get("kind", "step")
        if kind == "meta":
            run.meta = rec
        elif kind == "phase_end":
            run.end = rec
        elif kind == "step":
            run.steps.append(rec)
        elif kind == "quant_error":
            run.quant_errors.append(rec)
    if not any(r.steps for r in runs.values()):
        raise ValueError(f"{path} holds no step records")
    return runs


# What the report reads from each kind of record (fp8train.telemetry's step records, the demo's
# others); records of other kinds and fields not named here are ignored.
_NUMBER = (int, float)
RECORD_FIELDS: dict[str, dict[str, tuple]] = {
    "step": {"step": (int,), "roles": (dict,), "events": (dict,), "reduction": (dict,)},
    "quant_error": {"step": (int,), "rel_error": (dict,)},
    "phase_end": {"steps": (int,), "final_loss": _NUMBER},
}
OPTIONAL_FIELDS: dict[str, dict[str, tuple]] = {  # checked when present
    "meta": {"params": (int,), "recipe": (str,), "recipe_kind": (str, type(None))},
}
ROLE_FIELDS = ("amax", "scale", "util", "overflow")  # of each role of a step record
EVENT_FIELDS = ("overflow", "nonfinite")
REDUCTION_FIELDS = ("exposed_wait_s", "hidden_s", "launched")


def _checked_records(path: str) -> list[dict]:
    """read_metrics(path), after checking that every line is a record the report can read."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    for n, line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {n}: not JSON ({err.msg}, column {err.colno})") from None
    records = read_metrics(path)  # the same non-blank lines, "inf" and "nan" turned into floats
    for (n, _), rec in zip(lines, records):
        try:
            _check_record(rec)
        except ValueError as err:
            raise ValueError(f"{path}, line {n}: {err}; fp8train.telemetry did not write this line") from None
    return records


def _check_record(rec) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"a record is a JSON object, this line holds {_json_type(rec)}")
    kind, run = rec.get("kind", "step"), rec.get("run", "fp8")
    if not isinstance(kind, str) or not isinstance(run, str):
        raise ValueError(f'"kind" and "run" are strings, this record has {kind!r} and {run!r}')
    required, optional = RECORD_FIELDS.get(kind, {}), OPTIONAL_FIELDS.get(kind, {})
    for field, types in (required | optional).items():
        if field not in rec:
            if field in optional:
                continue
            raise ValueError(f'a "{kind}" record has a "{field}" field, this one has only {sorted(rec)}')
        if not isinstance(rec[field], types) or isinstance(rec[field], bool):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f'"{field}" of a "{kind}" record is {expected}, this one is {rec[field]!r}')
    if kind == "step":
        _check_fields(rec["events"], EVENT_FIELDS, '"events"', (int,))
        _check_fields(rec["reduction"], REDUCTION_FIELDS, '"reduction"', _NUMBER)
        for role, values in rec["roles"].items():
            _check_fields(values, ROLE_FIELDS, f'role "{role}"', None)
    elif kind == "quant_error":
        for gemm, values in rec["rel_error"].items():
            _check_fields(values, (), f'"rel_error" of GEMM "{gemm}"', None)
    elif kind == "phase_end":
        if rec["steps"] < 1:
            raise ValueError(f'"steps" of a "phase_end" record is >= 1, this one is {rec["steps"]}')
        per_rank = rec.get("reduction_per_rank") or []
        if not isinstance(per_rank, list):
            raise ValueError(f'"reduction_per_rank" is a list, this one is {_json_type(per_rank)}')
        for i, stats in enumerate(per_rank):
            _check_fields(stats, REDUCTION_FIELDS, f'"reduction_per_rank"[{i}]', _NUMBER)


def _check_fields(value, fields: tuple, what: str, types: Optional[tuple]) -> None:
    """`value` is an object holding `fields` (each of `types`, unless None)."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is an object, this one is {_json_type(value)}")
    for field in fields:
        if field not in value:
            raise ValueError(f'{what} has a "{field}" field, this one has only {sorted(value)}')
        if types is not None and (not isinstance(value[field], types) or isinstance(value[field], bool)):
            kind = "an integer" if types == (int,) else "a number"
            raise ValueError(f'"{field}" of {what} is {kind}, this one is {value[field]!r}')


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number") + f" ({json.dumps(value)[:40]})"


def _group_of(role: str) -> tuple[Optional[int], str]:
    """(layer index or None, the role's name within its layer), e.g. (0, "mlp/fc1/input")."""
    m = _LAYER.match(role)
    if m is None:
        return None, role
    return int(m.group(1)), role[m.end() :]


def _is_finite(v) -> bool:
    """A finite number (logged values may also be None or, in raw records, "inf"/"nan" strings)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def _finite_or_nan(values: list) -> list[float]:
    return [v if _is_finite(v) else float("nan") for v in values]


def _plot_roles(ax, series: dict, suffix: str, ylabel: str, title: str) -> None:
    """One line per role ending in `suffix`: colour = role within the layer, line style = layer."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    chosen = {n: s for n, s in series.items() if n.endswith("/" + suffix)}
    kinds = sorted({_group_of(n)[1] for n in chosen})
    colors = plt.get_cmap("tab10")
    layers = sorted({_group_of(n)[0] for n in chosen}, key=lambda x: -1 if x is None else x)
    for name, (xs, ys) in sorted(chosen.items()):
        layer, kind = _group_of(name)
        ax.plot(
            xs, _finite_or_nan(ys), color=colors(kinds.index(kind) % 10),
            linestyle=_STYLES[layers.index(layer) % len(_STYLES)], linewidth=1.2,
        )  # fmt: skip
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("step")
    ax.grid(True, which="major", alpha=0.3)
    handles = [
        Line2D([], [], color=colors(i % 10), label=k.removesuffix("/" + suffix)) for i, k in enumerate(kinds)
    ]
    if len(layers) > 1:
        handles += [
            Line2D([], [], color="0.3", linestyle=_STYLES[i % len(_STYLES)], label=f"layer {lay}")
            for i, lay in enumerate(layers)
        ]
    if handles:
        ax.legend(handles=handles, fontsize=7, ncol=2, loc="best", framealpha=0.8)


def clipped_share(util) -> float:
    """The share of the largest value a cast clipped at utilisation `util` (amax x scale / fp8_max):
    1 - 1/util above 1, else 0 (non-finite utilisation: 0, counted as non-finite elsewhere)."""
    return 1.0 - 1.0 / util if _is_finite(util) and util > 1.0 else 0.0


def reduction_figures(run: RunData) -> dict:
    """What the amax reduction cost a run, means over ranks: `exposed_ms` per step, the time the step
    stood still waiting (what the user pays), and `exposed_share` of the median step; `window_ms`,
    each reduction's mean time in flight from its launch to its wait, and `window_share` of the median
    step: time the reduction overlapped other work, which costs nothing (reduction_stats' `hidden_s`
    is the sum of these windows: a forward's and a backward's overlap each other and the step, so the
    sum can exceed the training time; it is not a cost). Shares are None without a step time."""
    stats = run.reduction()
    steps = run.end["steps"] if run.end else len(run.steps)
    out = {"exposed_ms": 0.0, "exposed_share": None, "window_ms": 0.0, "window_share": None,
           "launched": stats[0]["launched"] if stats else 0, "steps": steps}  # fmt: skip
    if not stats or steps == 0:
        return out
    out["exposed_ms"] = statistics.mean(s["exposed_wait_s"] for s in stats) * 1e3 / steps
    if out["launched"]:
        out["window_ms"] = statistics.mean(s["hidden_s"] for s in stats) * 1e3 / out["launched"]
    step_ms = run.median_step_ms()
    if step_ms:
        out["exposed_share"] = out["exposed_ms"] / step_ms
        out["window_share"] = out["window_ms"] / step_ms
    return out


def render(run_dir: str, out_name: str = "report.png") -> dict:
    """Write run_dir/report.png and run_dir/report.md; return their paths (and the metrics path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_run(run_dir)
    fp8_runs = [r for r in runs.values() if r.fp8 and r.steps]
    delayed = [r for r in fp8_runs if r.recipe_kind == "delayed"]
    primary = (delayed or fp8_runs or [next(r for r in runs.values() if r.steps)])[0]
    floor = _loss_floor(run_dir)
    timing = _summary(run_dir).get("step_timing")

    fig = plt.figure(figsize=(13, 27), dpi=100)
    grid = fig.add_gridspec(6, 2, height_ratios=[1, 0.8, 0.8, 1, 1, 1.7], hspace=0.35, wspace=0.2,
                            top=0.96)  # fmt: skip
    title = f"fp8train report: {os.path.basename(os.path.normpath(run_dir))}"
    meta = primary.meta
    if meta:
        title += (
            f"\n{meta.get('model_size', '')} GPT ({meta.get('params', 0):,} params), "
            f"{meta.get('world_size')} ranks on {meta.get('device')}, {meta.get('steps')} steps, "
            f"{_recipe_text(meta.get('recipe', ''))}"
        )
        others = list(dict.fromkeys(r.recipe_kind for r in fp8_runs if r.recipe_kind != "delayed"))
        if others:
            title += "; also " + ", ".join(others)
        if meta.get("data"):
            data = "real text (stdlib source, bytes)" if meta["data"] == "text" else meta["data"]
            title += f"; data: {data}"
    fig.suptitle(title, fontsize=12, y=0.985)

    _plot_losses(fig.add_subplot(grid[0, 0]), runs, floor)
    _plot_reduction(fig.add_subplot(grid[0, 1]), delayed)
    _plot_side_by_side(fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]), runs, timing,
                       bf16_note(_summary(run_dir)))  # fmt: skip
    _plot_quant_errors([fig.add_subplot(cell) for cell in grid[2, :].subgridspec(1, 3, wspace=0.3)], runs)

    for row, (suffix, what) in enumerate(
        (("input", "forward input"), ("grad_output", "gradient (grad_output)")), 3
    ):
        _plot_roles(fig.add_subplot(grid[row, 0]), primary.role_series("amax"), suffix, "amax (reduced)",
                    f"{primary.name}: amax history, {what} roles")  # fmt: skip
        _plot_roles(fig.add_subplot(grid[row, 1]), primary.role_series("scale"), suffix, "scale",
                    f"{primary.name}: scale history, {what} roles")  # fmt: skip

    _plot_utilisation(fig.add_subplot(grid[5, :]), primary)

    png = os.path.join(run_dir, out_name)
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)
    md = os.path.join(run_dir, "report.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write(_markdown(run_dir, runs, fp8_runs, floor, out_name, timing))
    return {"png": png, "markdown": md, "metrics": os.path.join(run_dir, METRICS_FILE)}


def _plot_losses(ax, runs: dict[str, RunData], floor: Optional[float]) -> None:
    """Every run's loss curve (the reference grey and thick, underneath; each FP8 run its own dash and
    markers, and a run whose losses equal an earlier run's bit for bit says so), the loss floor if
    known, and an inset of each FP8 run's loss minus the reference's, where curves that coincide at
    the main plot's scale come apart."""
    seen: dict[tuple, str] = {}
    for i, run in enumerate(runs.values()):
        xs, ys = run.losses()
        if not xs:
            continue
        label = f"{run.name}: final {run.final_loss():.3f}"
        twin = seen.setdefault((tuple(xs), tuple(ys)), run.name)
        if twin != run.name:
            label += f" (= {twin}, bit for bit)"
        style = dict(color=f"C{i}", linewidth=1.3, linestyle=_STYLES[i % len(_STYLES)],
                     marker=_MARKERS[i % len(_MARKERS)], markersize=4, markerfacecolor="none",
                     markevery=(i * max(1, len(xs) // 40), max(1, len(xs) // 10)))  # fmt: skip
        if run.name == "reference":
            style = dict(color="0.45", linewidth=2.2, alpha=0.8)
        ax.plot(xs, _finite_or_nan(ys), label=label, **style)
    if floor is not None:
        ax.axhline(floor, color="k", linestyle=":", linewidth=1, label=f"loss floor {floor:.3f}")
    ax.set_title("Training loss: FP8 runs vs the fp32 reference", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none when no run logged a loss
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.8 * (high - low))  # the curves below, the legend and inset above
        ax.legend(fontsize=7, loc="upper left")
    _plot_loss_differences(ax, runs)


def loss_differences(runs: dict[str, RunData], window: int = 10) -> dict[str, tuple[list[int], list[float]]]:
    """Each FP8 run's loss minus the reference's at the same steps, as a running mean over `window`
    steps (per-step losses are noisy); {} without a reference."""
    ref = runs.get("reference")
    if ref is None:
        return {}
    ref_loss = dict(zip(*ref.losses()))
    out = {}
    for run in runs.values():
        if run is ref:
            continue
        pairs = [(x, y - ref_loss[x]) for x, y in zip(*run.losses()) if x in ref_loss and _is_finite(y)]
        if pairs:
            diffs = [d for _, d in pairs]
            means = [statistics.fmean(diffs[max(0, k - window + 1) : k + 1]) for k in range(len(diffs))]
            out[run.name] = ([x for x, _ in pairs], means)
    return out


def _plot_loss_differences(ax, runs: dict[str, RunData]) -> None:
    differences = loss_differences(runs)
    if not differences:
        return
    inset = ax.inset_axes((0.42, 0.33, 0.55, 0.33))
    names = list(runs)
    for name, (xs, ys) in differences.items():
        i = names.index(name)
        inset.plot(xs, ys, color=f"C{i}", linewidth=1.1, linestyle=_STYLES[i % len(_STYLES)])
    inset.axhline(0, color="0.45", linewidth=1.5)
    inset.set_title("loss - fp32 reference (10-step mean)", fontsize=7)
    inset.tick_params(labelsize=6)
    inset.grid(True, alpha=0.3)


def _colors(runs: dict[str, RunData]) -> dict[str, str]:
    """One colour per run, the same in every panel (the reference grey)."""
    return {name: "0.45" if name == "reference" else f"C{i}" for i, name in enumerate(runs)}


def bf16_note(summary: dict) -> Optional[str]:
    """Why bf16 autocast is slow in this run, where the demo found no bf16 instructions on its CPU
    (summary.json's cpu_bf16_instructions, from gemm.cpu_bf16_instructions); None otherwise."""
    facts = summary.get("cpu_bf16_instructions")
    if not isinstance(facts, dict) or facts.get("native", True):
        return None
    return (
        f"bf16 autocast is slow here: {facts.get('why', 'this CPU has no bf16 instructions')}, so torch's "
        "bf16 GEMMs run without hardware support; the FP8 runs multiply their exact values in an fp32 "
        'GEMM instead (docs/benchmarks.md, "CPUs with and without bf16 instructions")'
    )


def _plot_side_by_side(
    ax_loss, ax_time, runs: dict[str, RunData], timing: Optional[dict], bf16: Optional[str] = None
) -> None:
    """Per run: final loss relative to the reference, with clipped casts; step time (the timed pass's
    interleaved medians when the run has one, else each run's own sequential median), bf16 autocast's
    bar annotated where the CPU has no bf16 instructions (`bf16`: why)."""
    shown = [r for r in runs.values() if r.steps]
    ref = runs.get("reference")
    ref_loss = ref.final_loss() if ref is not None else None
    names = [r.name for r in shown]
    color = _colors(runs)
    if ref_loss:
        rel = [100 * ((r.final_loss() or math.nan) - ref_loss) / ref_loss for r in shown]  # no loss: nan
        ticks = [f"{_short(r.name)}\n{_saturation_text(r)}" for r in shown]
        bars = ax_loss.bar(ticks, rel, color=[color[n] for n in names])
        ax_loss.bar_label(bars, fmt="%+.2f%%", fontsize=8, padding=2)
        ax_loss.axhline(0, color="k", linewidth=0.8)
        ax_loss.set_ylim(*_label_room([v for v in rel if _is_finite(v)]))
        ax_loss.set_ylabel("final loss vs reference (%)")
    else:
        ax_loss.text(0.5, 0.5, "no reference run", ha="center", va="center", transform=ax_loss.transAxes)
    ax_loss.set_title("Final loss relative to the fp32 reference (and clipped casts)", fontsize=10)
    if timing:
        times = dict(timing["median_ms"])
        ref_ms = times.get("reference")
        labels = [f"{t:.1f} ms" + (f"\n{t / ref_ms:.2f}x" if ref_ms else "") for t in times.values()]
        if bf16:
            labels = [
                label + ("\n(no bf16 on\nthis CPU)" if timing["recipe_kind"].get(n) == "bf16" else "")
                for n, label in zip(times, labels)
            ]
        title = (
            f"Step time: interleaved pass ({timing['rounds']} rounds x {timing['block']} steps; median, "
            "quartiles)"
        )
    else:
        times = {r.name: r.median_step_ms() or 0.0 for r in shown}
        labels = [f"{t:.1f} ms" for t in times.values()]
        title = "Step time: median of each run (sequential runs: noisy on a shared machine)"
    q = (timing or {}).get("quartiles_ms", {})
    err = None
    if q and all(n in q for n in times):  # the interquartile range around each median
        err = [[t - q[n][0] for n, t in times.items()], [q[n][1] - t for n, t in times.items()]]
    bars = ax_time.bar([_short(n) for n in times], list(times.values()), yerr=err, capsize=3,
                       error_kw={"elinewidth": 0.8, "ecolor": "0.3"},
                       color=[color.get(n, "0.7") for n in times])  # fmt: skip
    tops = [q[n][1] if err else t for n, t in times.items()]  # labels above the error bars
    for bar, top, label in zip(bars, tops, labels):
        ax_time.text(bar.get_x() + bar.get_width() / 2, top, label, ha="center", va="bottom", fontsize=7)
    ax_time.set_ylabel("median step (ms)")
    ax_time.set_title(title, fontsize=10)
    if bf16 and timing:
        ax_time.text(0.5, -0.16, textwrap.fill(bf16, 110), ha="center", va="top", fontsize=7,
                     transform=ax_time.transAxes)  # fmt: skip
    ax_time.set_ylim(0, max(tops, default=1.0) * (1.6 if bf16 else 1.35) or 1.0)
    for ax in (ax_loss, ax_time):
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="y", alpha=0.3)


def _label_room(values: list[float]) -> tuple[float, float]:
    """y limits holding 0 and every bar of `values` with room for a label above (or below) each, so
    that no label reaches the title, even when every bar is 0."""
    lo, hi = min([0.0, *values]), max([0.0, *values])
    span = max(hi - lo, 0.05)
    return lo - (0.3 * span if lo < 0 else 0.1 * span), hi + 0.3 * span


def _plot_quant_errors(axes: list, runs: dict[str, RunData]) -> None:
    """Per role, each recipe's relative quantization error on the sampled GEMMs' tensors over the
    steps (one run per recipe kind: delayed scaling's second reduction mode is the same)."""
    color = _colors(runs)
    kinds, chosen = set(), []
    for run in runs.values():
        if run.quant_errors and run.recipe_kind not in kinds:
            kinds.add(run.recipe_kind)
            chosen.append(run)
    gemms = sorted({g for run in chosen for rec in run.quant_errors for g in rec["rel_error"]})
    for ax, role in zip(axes, ROLES):
        for i, run in enumerate(chosen):
            xs, ys = run.quant_error_series(role)
            snr = [-20 * math.log10(e) if e > 0 else float("nan") for e in ys]
            ax.plot(xs, snr, marker=_MARKERS[i % len(_MARKERS)], markersize=4, markerfacecolor="none",
                    linewidth=1.2, linestyle=_STYLES[i % len(_STYLES)], color=color[run.name],
                    label=run.recipe_kind)  # fmt: skip
        ax.set_title(f"Quantization SNR: {ROLE_TEXT[role]}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    if not chosen:
        for ax in axes:
            ax.text(
                0.5, 0.5, "no quantization error measured", ha="center", va="center", transform=ax.transAxes
            )
        return
    axes[0].set_ylabel("-20 log10(||dequant(quant(t)) - t|| / ||t||)  (dB)", fontsize=8)
    axes[0].legend(fontsize=7, loc="best")
    what = ", ".join(gemms) if len(gemms) <= 4 else f"{len(gemms)} GEMMs"
    axes[1].text(0.5, -0.22, f"higher is better; relative error averaged over the sampled GEMMs ({what}), "
                 "each recipe on its own run's tensors",
                 ha="center", va="top", fontsize=7, transform=axes[1].transAxes)  # fmt: skip


def _short(name: str) -> str:
    """A run's name for a crowded axis: without the "fp8-" every FP8 run has."""
    return name.removeprefix("fp8-").removesuffix("-autocast")


def _saturation_text(run: RunData) -> str:
    if not run.fp8:
        return "no FP8"
    if run.recipe_kind != "delayed":
        return "0 clipped"  # own amax
    clip = run.clipping()
    if not clip["clipped"]:
        return "0 clipped"
    return f"{clip['clipped']} clipped\n<= {100 * clip['max_share']:.1f}% each"


def _plot_reduction(ax, fp8_runs: list[RunData]) -> None:
    """What each delayed-scaling run's step paid for the amax reduction (exposed time per step: the
    bars), and, as text, how long each reduction was in flight behind compute as a share of the step
    (never a bar: overlapped time costs nothing)."""
    if not fp8_runs:
        ax.text(0.5, 0.5, "no delayed-scaling run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    figures = [reduction_figures(run) for run in fp8_runs]
    color = {run.name: f"C{i}" for i, run in enumerate(fp8_runs)}
    names = [f"{_short(run.name)}\n{f['launched']} reductions / {f['steps']} steps" + _window_text(f)
             for run, f in zip(fp8_runs, figures)]  # fmt: skip
    bars = ax.bar(names, [f["exposed_ms"] for f in figures], width=0.5,
                  color=[color[run.name] for run in fp8_runs])  # fmt: skip
    for bar, f in zip(bars, figures):
        share = "" if f["exposed_share"] is None else f"\n{100 * f['exposed_share']:.2f}% of the step"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{f['exposed_ms']:.3f} ms{share}",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    top = max(f["exposed_ms"] for f in figures)
    ax.set_ylim(0, (top or 1.0) * 1.6)
    ax.set_ylabel("exposed ms per step (mean over ranks)")
    ax.set_title("Amax all-reduce: time each step waits for it (what you pay)", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def _window_text(figures: dict) -> str:
    """A run's overlap, for its axis label: each reduction's time in flight as a share of the step."""
    if figures["window_share"] is None or figures["window_ms"] <= 0:
        return "\nwaited on at once (nothing overlapped)" if figures["launched"] else ""
    return (
        f"\nin flight {figures['window_ms']:.1f} ms each = {100 * figures['window_share']:.0f}% of a step,"
        "\noverlapped with compute (not a cost)"
    )


def _plot_utilisation(ax, run: RunData) -> None:
    """Heat map of range utilisation (amax * scale_used / fp8_max), roles x steps; > 1 = overflow."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    series = run.role_series("util")
    order = {"input": 0, "grad_output": 1, "weight": 2}
    kind_of = {n: order.get(n.rsplit("/", 1)[-1], 3) for n in series}
    names = sorted(series, key=lambda n: (kind_of[n], _sort_key(n)))
    if not names:
        ax.text(0.5, 0.5, "no FP8 roles recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    steps = sorted({s for xs, _ in series.values() for s in xs})
    index = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    for row, name in enumerate(names):
        xs, ys = series[name]
        for x, y in zip(xs, _finite_or_nan(ys)):
            grid[row, index[x]] = y
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5)
    cmap = plt.get_cmap("viridis").with_extremes(bad="magenta")
    image = ax.imshow(np.where(grid > 1.0, 1.0, grid), aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=0.0, vmax=1.0, extent=extent)  # fmt: skip
    bar = ax.figure.colorbar(image, cax=ax.inset_axes((1.01, 0.0, 0.012, 1.0)))
    bar.set_label("utilisation (up to 1)", fontsize=8)
    # where a cast clipped: coloured by the share of the largest value it lost, in reds that viridis
    # does not use, from light (a fraction of a percent) to dark (the worst clip, at least 5%)
    with np.errstate(invalid="ignore", divide="ignore"):
        clipped = np.where(grid > 1.0, 1.0 - 1.0 / grid, np.nan)
    clip = run.clipping()
    if clip["clipped"]:
        reds = LinearSegmentedColormap.from_list("clipped", plt.get_cmap("Reds")(np.linspace(0.2, 1.0, 64)))
        shown = ax.imshow(clipped, aspect="auto", interpolation="nearest", cmap=reds, vmin=0.0,
                          vmax=max(0.05, clip["max_share"]), extent=extent)  # fmt: skip
        bar = ax.figure.colorbar(shown, cax=ax.inset_axes((1.08, 0.0, 0.012, 1.0)),
                                 format=lambda v, _: f"{100 * v:.3g}%")  # fmt: skip
        bar.set_label("clipped: share of the largest value lost", fontsize=8)
    labels = [
        n if layer is None else f"L{layer} {kind}" for n, (layer, kind) in zip(names, map(_group_of, names))
    ]
    ax.set_yticks(range(len(names)), labels, fontsize=max(4, min(8, 420 // len(names))))
    for row in range(1, len(names)):
        if kind_of[names[row]] != kind_of[names[row - 1]]:
            ax.axhline(row - 0.5, color="white", linewidth=2)
    ax.set_xlabel("step\n\n" + textwrap.fill(clipping_text(clip), 170), fontsize=9)
    ax.set_title(
        f"{run.name}: FP8 range utilisation per role (amax x scale used / fp8_max; red where a cast clipped, "
        "by the share of the largest value lost; magenta: non-finite)", fontsize=10,
    )  # fmt: skip


def clipping_text(clip: dict) -> str:
    """What the clipped casts amount to, and what to do if it matters (the report's summary)."""
    if not clip["clipped"]:
        return f"no cast clipped in {clip['role_steps']:,} role-steps"
    return (
        f"{clip['clipped']:,} of {clip['role_steps']:,} role-steps clipped their largest values, by "
        f"{100 * clip['median_share']:.1f}% (median) and at most {100 * clip['max_share']:.1f}%: delayed "
        "scaling casts with earlier steps' amaxes, so a growing tensor overshoots slightly. "
        + (
            "If it matters (a loss that drifts from the reference), DelayedScaling(margin=1) leaves 2x "
            "headroom (and gives up one binade at the bottom of the range)."
            if clip["max_share"] >= 0.01
            else "Under 1%: harmless."
        )
    )


def _sort_key(role: str) -> tuple:
    layer, kind = _group_of(role)
    return (-1 if layer is None else layer, kind)


def _recipe_text(recipe: str) -> str:
    """A short form of a DelayedScaling repr for titles: format, margin, history length."""
    fmt = re.search(r"Format\.(\w+)", recipe)
    margin = re.search(r"margin=(\d+)", recipe)
    hist = re.search(r"amax_history_len=(\d+)", recipe)
    algo = re.search(r"amax_compute_algo='(\w+)'", recipe)
    if not (fmt and margin and hist):
        return recipe[:80]
    text = f"{fmt.group(1)}, margin {margin.group(1)}, amax history {hist.group(1)}"
    return text + (f" ({algo.group(1)})" if algo else "")


def _summary(run_dir: str) -> dict:
    """The demo's summary.json (absent for runs written by other training loops)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            summary = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    timing = summary.get("step_timing") if isinstance(summary, dict) else None
    if not isinstance(summary, dict) or not (timing is None or _is_step_timing(timing)):
        raise ValueError(
            f"{path}: not the summary the demo writes (an object whose step_timing, if any, has "
            '"median_ms" and "recipe_kind" objects and "rounds" and "block" counts)'
        )
    return summary


def _is_step_timing(timing) -> bool:
    return (
        isinstance(timing, dict)
        and all(isinstance(timing.get(k), dict) for k in ("median_ms", "recipe_kind"))
        and all(isinstance(timing.get(k), int) for k in ("rounds", "block"))
        and all(_is_finite(v) for v in timing["median_ms"].values())
    )


def _loss_floor(run_dir: str) -> Optional[float]:
    return _summary(run_dir).get("loss_floor")


def _markdown(
    run_dir: str, runs: dict, fp8_runs: list, floor: Optional[float], png: str, timing: Optional[dict]
) -> str:
    ref = runs.get("reference")
    ref_loss = ref.final_loss() if ref is not None else None
    out = [f"# fp8train run report: `{os.path.normpath(run_dir)}`", "", f"![report]({png})", ""]
    data = _summary(run_dir).get("data")
    if data:
        out += [f"Data: {data}.", ""]
    interleaved = timing["median_ms"] if timing else {}
    spread = (timing or {}).get("quartiles_ms", {})
    ref_ms = interleaved.get("reference")
    out += [
        "| run | recipe | steps | final loss | vs reference | step ms (interleaved) | vs fp32 | quartiles ms "
        "| step ms (sequential) | amax reductions | exposed ms/step (% of step) | in flight per reduction, "
        "overlapped (% of step) | clipped role-steps (max share) | non-finite |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs.values():
        if not run.steps:
            continue
        loss = run.final_loss()  # None: a run whose records hold no loss
        loss_text = "" if loss is None else f"{loss:.4f}"
        rel = (
            f"{100 * (loss - ref_loss) / ref_loss:+.2f}%"
            if ref_loss and loss is not None and run is not ref
            else ""
        )
        red = reduction_figures(run)
        ev = run.events()
        step_ms = run.median_step_ms()
        clip = run.clipping()
        clipped = f"{clip['clipped']} ({100 * clip['max_share']:.1f}%)" if clip["clipped"] else "0"
        clipped = {"delayed": clipped, None: ""}.get(run.recipe_kind, "none (own amax)")
        out.append(
            f"| {run.name} | {run.recipe_kind or 'fp32'} | {red['steps']} | {loss_text} | {rel} "
            f"| {_interleaved_cells(interleaved.get(run.name), ref_ms, spread.get(run.name))} "
            f"| {'' if step_ms is None else f'{step_ms:.1f}'} | {red['launched']} "
            f"| {red['exposed_ms']:.4f}{_pct_text(red['exposed_share'])} "
            f"| {red['window_ms']:.2f} ms{_pct_text(red['window_share'])} | {clipped} | {ev['nonfinite']} |"
        )
    for name, ms in interleaved.items():
        if name not in runs:  # timed only (bf16 autocast)
            kind = timing["recipe_kind"].get(name, "")
            cells = _interleaved_cells(ms, ref_ms, spread.get(name))
            out.append(f"| {name} | {kind} | | | | {cells} | | | | | | |")
    out.append("")
    out.append(_timing_text(timing))
    note = bf16_note(_summary(run_dir))
    if note and timing:
        out += ["", note + "."]
    out.append("")
    table = _quant_error_table(runs)
    if table:
        out.append(table)
    out.append(
        "Final loss: mean over the last 10% of steps. Reduction times: mean over ranks. Exposed = time "
        "the step stood still waiting for the amax all-reduce, the cost (in blocking mode this includes "
        "waiting for the slowest rank, which asynchronous mode moves to the next collective, e.g. the "
        "gradient all-reduce); in flight = each reduction's time from its launch to its wait, overlapped "
        "with other work: not a cost (reduction_stats()'s hidden_s sums these windows, which overlap each "
        "other, so it can exceed the training time)."
    )
    if floor is not None:
        out.append(f"Loss floor (entropy of the synthetic language): {floor:.4f}.")
    ends = [r.end for r in fp8_runs if r.end and r.recipe_kind == "delayed"]
    if len(ends) == 2:
        same = all(ends[0][k] == ends[1][k] for k in ("loss_digest", "fp8_state_digest"))
        out.append(
            f"Async and blocking FP8 runs bit-identical (every loss, final scales and amax histories): "
            f"**{'yes' if same else 'NO'}**."
        )
    if any(r.recipe_kind not in (None, "delayed") for r in fp8_runs):
        out.append(
            "Clipped: role-steps whose amax x scale used exceeded fp8_max (the cast saturated). The other "
            "recipes scale each tensor (current scaling), 1x128 tile or 128x128 block (block scaling), "
            "32-block (MXFP8) or 16-block and tensor (NVFP4) by its own amax just before the cast, so "
            "nothing saturates by construction; delayed scaling uses earlier steps' amaxes."
        )
    delayed = [r for r in fp8_runs if r.recipe_kind == "delayed"]
    section = coverage_section(run_dir, runs)  # report_coverage.py
    if section:
        out += ["", section]
    if delayed:
        run = delayed[0]
        utils = {n: [v for v in ys if _is_finite(v)] for n, (_, ys) in run.role_series("util").items()}
        med = sorted((statistics.median(v), n) for n, v in utils.items() if v)
        if med:
            out += [
                "",
                f"Median range utilisation in {run.name} (lowest first; 1.0 = the full FP8 range):",
                "",
            ]
            out += [f"- `{n}`: {u:.3f}" for u, n in med[:5]]
            out.append(f"- ... highest: `{med[-1][1]}`: {med[-1][0]:.3f}")
        out += ["", _overflow_table(run)]
    out += _experts_table(delayed[0] if delayed else None)
    out += _memory_table(run_dir)
    out.append("")
    return "\n".join(out)


def _experts_table(run) -> list[str]:
    """MoE models (`fp8train demo --model moe`): per expert, the tokens rank 0 routed to it and its
    up-projection input's amax and scale at the last logged step of a delayed-scaling run."""
    if run is None or not run.steps or "tokens_per_expert" not in run.steps[-1]:
        return []
    last = run.steps[-1]
    out = ["", f"Experts at step {last['step']} of {run.name} (tokens: rank 0's routing; amax: reduced):", ""]
    out += ["| block | expert | tokens | input amax | input scale |", "|---|---:|---:|---:|---:|"]
    for block, counts in last["tokens_per_expert"].items():
        for expert, tokens in enumerate(counts):
            role = last["roles"].get(f"{block}.up/{expert}/input", {})
            amax, scale = role.get("amax"), role.get("scale")
            cells = [f"{v:.4g}" if _is_finite(v) else "" for v in (amax, scale)]
            out.append(f"| {block} | {expert} | {tokens} | {cells[0]} | {cells[1]} |")
    return out


def _pct_text(share: Optional[float]) -> str:
    return "" if share is None else f" ({100 * share:.2f}%)"


def _memory_table(run_dir: str) -> list[str]:
    """`fp8train bench memory --out RUN_DIR`'s figures (memory.json), if the run has them."""
    path = os.path.join(run_dir, "memory.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = ["", "Memory of one training step (`fp8train bench memory`), MB:", ""]
    out += ["| config | params | grads | optimizer | saved | sum | vs bf16 autocast |", "|---|" + "---:|" * 6]
    for r in rows:
        cells = [r[k] for k in ("params_MB", "grads_MB", "optim_state_MB", "saved_MB", "sum_MB")]
        out.append(
            f"| {r['config']} | " + " | ".join(f"{v:.2f}" for v in cells) + f" | {r['sum_vs_bf16']:.2f} |"
        )
    return out


def _interleaved_cells(ms: Optional[float], ref_ms: Optional[float], q: Optional[list]) -> str:
    """The cells median | ratio to fp32 | quartiles of a configuration's interleaved step times."""
    if ms is None:
        return " |  | "
    ratio = f"{ms / ref_ms:.2f}x" if ref_ms else ""
    return f"{ms:.1f} | {ratio} | " + (f"{q[0]:.1f} - {q[1]:.1f}" if q else "")


def _timing_text(timing: Optional[dict]) -> str:
    """How the step times were measured (so that a reader knows which column to compare)."""
    sequential = (
        "Step ms (sequential): the median step of each training run; the runs follow one another, so a "
        "change of machine load between them (another job) shows as a difference of recipe."
    )
    if not timing:
        return sequential + " No interleaved pass was run (--timing-rounds 0): do not compare them closely."
    return (
        f"Step ms (interleaved): measured after training in a separate pass that alternates every "
        f"configuration (fresh models, the training step without telemetry) in blocks of {timing['block']} "
        f"steps, one untimed block each, then {timing['rounds']} rounds with the order rotated; a step's "
        "time is that of its slowest rank; the median and quartiles of each configuration's steps. Every "
        "configuration sees the same load, so these are the ones to compare (the quartiles say how much "
        "the load moved them); vs fp32 is the ratio of medians. " + sequential
    )


def _quant_error_table(runs: dict) -> str:
    """Mean relative quantization error (and SNR) per recipe and role, over the measured steps."""
    rows, kinds = [], set()
    for run in runs.values():
        if not run.quant_errors or run.recipe_kind in kinds:
            continue
        kinds.add(run.recipe_kind)
        cells = []
        for role in ROLES:
            _, ys = run.quant_error_series(role)
            mean = statistics.fmean(ys) if ys else float("nan")
            cells.append(f"{mean:.4f} ({-20 * math.log10(mean):.1f} dB)" if mean > 0 else f"{mean:.4f}")
        rows.append(
            f"| {run.name} | {run.recipe_kind} | " + " | ".join(cells) + f" | {len(run.quant_errors)} |"
        )
    if not rows:
        return ""
    gemms = sorted({g for run in runs.values() for rec in run.quant_errors for g in rec["rel_error"]})
    return "\n".join(
        [
            "Quantization error on the model's tensors: ||dequant(quant(t)) - t|| / ||t|| (SNR in dB), mean "
            f"over the measured steps and the sampled GEMMs ({', '.join(f'`{g}`' for g in gemms)}), each "
            "recipe's own quantization applied to the tensors of its own run: the GEMM input and the weight "
            "as the forward GEMM takes them, the output gradient as the input-gradient GEMM takes it.",
            "",
            "| run | recipe | input | weight | grad_output | steps measured |",
            "|---|---|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )


def _overflow_table(run: RunData) -> str:
    """Overflow (saturated cast) counts and the worst utilisation, per kind of role."""
    kinds: dict[str, list] = {}
    for rec in run.steps:
        for name, values in rec["roles"].items():
            entry = kinds.setdefault(name.rsplit("/", 1)[-1], [0, 0, 0.0])
            entry[0] += 1
            entry[1] += bool(values["overflow"])
            if _is_finite(values["util"]):
                entry[2] = max(entry[2], values["util"])
    lines = [
        f"Overflow events in {run.name} (a cast saturated: amax x scale used > fp8_max):",
        "",
        "| role kind | role-steps | overflow | max utilisation (share clipped) |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {k} | {n} | {o} | {u:.3f} ({100 * clipped_share(u):.1f}%) |"
        for k, (n, o, u) in sorted(kinds.items())
    ]
    lines += [
        "",
        "A max utilisation of 1.01 means the largest value was clipped by 1% of itself. "
        + clipping_text(run.clipping()),
    ]
    return "\n".join(lines)
