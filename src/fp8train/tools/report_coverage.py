"""The report's coverage and tensor-statistics section (Markdown): which layers ran in FP8, every
stretch of steps whose FP8 FLOP share differs from the run's first (a layer switched to high
precision mid-run shows here, with its name), and the sampled GEMMs' tensor statistics."""

from __future__ import annotations

import math
import os
from typing import Optional

from fp8train.telemetry import METRICS_FILE, read_metrics
from fp8train.tensor_stats import KURTOSIS_WARNING

__all__ = ["coverage_section", "share_changes"]


def share_changes(steps: list[dict]) -> list[tuple[int, int, Optional[float], list[str]]]:
    """(first step, last step, FP8 FLOP share, high-precision layers) of each stretch of logged steps
    with the same share and layers, for the stretches that differ from the first logged step's."""
    stretches: list[list] = []
    for rec in steps:
        cov = rec.get("coverage")
        if cov is None:
            continue
        key = (cov["fp8_flop_share"], cov["high_precision_layers"])
        if stretches and (stretches[-1][2], stretches[-1][3]) == key:
            stretches[-1][1] = rec["step"]
        else:
            stretches.append([rec["step"], rec["step"], *key])
    if not stretches:
        return []
    first = (stretches[0][2], stretches[0][3])
    return [tuple(s) for s in stretches if (s[2], s[3]) != first]


def _pct(share: Optional[float]) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _layers_text(record: dict) -> str:
    others = [x for x in record["layers"] if not x["fp8"]]
    names = ", ".join(f"`{x['name']}` ({x['reason']})" for x in others[:6])
    more = f" and {len(others) - 6} more" if len(others) > 6 else ""
    return names + more if others else "none"


def _statistics_table(steps: list[dict]) -> list[str]:
    per_role: dict[str, dict[str, list]] = {}
    for rec in steps:
        for role, stats in (rec.get("statistics") or {}).items():
            for key, value in stats.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    per_role.setdefault(role, {}).setdefault(key, []).append((value, rec["step"]))
    if not per_role:
        return []
    out = [
        "| GEMM role | max kurtosis (step) | max zero share | max subnormal share | max block-scale spread "
        "(log2) | mean rel. error | mean what-if error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    flagged = []
    for role, stats in sorted(per_role.items()):
        biggest = {k: f"{max(v)[0]:.4g}" for k, v in stats.items()}
        mean = {k: f"{sum(x for x, _ in v) / len(v):.4g}" for k, v in stats.items()}
        kurt = max(stats["kurtosis"]) if "kurtosis" in stats else None
        if kurt is not None and role.endswith("/input") and kurt[0] > KURTOSIS_WARNING:
            flagged.append(f"`{role}` {kurt[0]:.1f} at step {kurt[1]}")
        out.append(
            f"| `{role}` | {'-' if kurt is None else f'{kurt[0]:.2f} ({kurt[1]})'} "
            f"| {biggest.get('zero_share', '-')} | {biggest.get('subnormal_share', '-')} "
            f"| {biggest.get('scale_spread_log2', '-')} | {mean.get('rel_error', '-')} "
            f"| {mean.get('what_if_rel_error', '-')} |"
        )
    out.append("")
    threshold = f"{KURTOSIS_WARNING:g}"
    if flagged:
        out.append(f"**Input kurtosis above {threshold}** (docs/telemetry.md): " + "; ".join(flagged) + ".")
    else:
        out.append(
            f"No GEMM input's kurtosis exceeded {threshold} (the warning threshold, docs/telemetry.md)."
        )
    return out


def coverage_section(run_dir: str, runs: dict) -> str:
    """The section, from the run directory's "coverage" records and the step records of `runs`
    (report.RunData by name); "" when the run logged neither."""
    path = os.path.join(run_dir, METRICS_FILE)
    layers = {r.get("run", "fp8"): r for r in read_metrics(path) if r.get("kind") == "coverage"}
    bodies: dict[str, list[str]] = {}  # body -> the runs that have it (async and blocking: one section)
    for name, run in runs.items():
        steps = [r for r in run.steps if r.get("coverage") is not None or r.get("statistics")]
        if name not in layers and not steps:
            continue
        out: list[str] = []
        if name in layers:
            rec = layers[name]
            fp8 = sum(x["fp8"] for x in rec["layers"])
            out.append(
                f"Linear GEMMs in FP8: {fp8}/{len(rec['layers'])} ({_pct(rec['fp8_share'])} of linear FLOPs, "
                f"recipe {rec['recipe']}); in high precision: {_layers_text(rec)}."
            )
        shares = [r["coverage"]["fp8_flop_share"] for r in steps if r.get("coverage")]
        if shares:
            first = steps[0]["coverage"]
            gathered = [r["coverage"]["gathered_bytes"] for r in steps if r.get("coverage")]
            fp8_bytes, hp_bytes = sum(g["fp8"] for g in gathered), sum(g["high_precision"] for g in gathered)
            text = (
                f"FP8 FLOP share per logged step: {_pct(first['fp8_flop_share'])} at step {steps[0]['step']}"
            )
            if fp8_bytes or hp_bytes:
                text += f"; FSDP2 gathered {fp8_bytes:,} B in FP8, {hp_bytes:,} B in high precision"
            out.append(text + ".")
            for start, stop, share, hp in share_changes(steps):
                where = f"step {start}" if start == stop else f"steps {start}-{stop}"
                names = ", ".join(f"`{n}`" for n in hp) or "none"
                out.append(
                    f"- **FP8 share {_pct(share)} at {where}** (FP8 layers in high precision: {names})"
                )
        out += [""] + _statistics_table(steps) + [""]
        bodies.setdefault("\n".join(out), []).append(name)
    if not bodies:
        return ""
    sections = [f"### {', '.join(names)}\n\n{body}" for body, names in bodies.items()]
    return "\n".join(["## Coverage and tensor statistics", "", *sections])
