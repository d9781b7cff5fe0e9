"""Bench suites of two fp8train source trees side by side: after/before ratios with their spread.

    python scripts/compare_trees.py BEFORE AFTER [--repeats 5] [--suites fused step] [--python PY]
                                    [--out compare.json] [-- BENCH_ARGS...]

BEFORE and AFTER are checkouts (their src/ is put first on PYTHONPATH). One run alternates them,
BEFORE AFTER, AFTER BEFORE, ... (a drift in the machine's load falls on both), each repetition a
fresh process of `python -m fp8train.tools.bench SUITES --out DIR BENCH_ARGS` with one thread
(OMP_NUM_THREADS=MKL_NUM_THREADS=1; a suite that sets its own thread count, `step` without --quick,
still does). BENCH_ARGS go to every run (e.g. `-- --quick`, `-- --no-compile`).

Each numeric figure of each row of each suite's JSON is paired by repetition: the ratio after/before
of repetition i uses the i-th run of each tree. Printed per figure: the median of each tree, the
median ratio, and the lowest and highest ratio over the repetitions. A row is named by its text
fields (its configuration) and `threads` where a suite has it; the rows of the two trees must match.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

TREES = ("before", "after")


def _env(tree: pathlib.Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def check_tree(python: str, tree: pathlib.Path) -> None:
    """The child really imports this tree's fp8train (not an installed copy)."""
    code = "import fp8train, os; print(os.path.realpath(fp8train.__file__))"
    out = subprocess.run([python, "-c", code], env=_env(tree), capture_output=True, text=True, timeout=300)
    found = out.stdout.strip()
    if out.returncode or not found.startswith(os.path.realpath(tree / "src")):
        raise SystemExit(f"{tree}: its src/ does not provide fp8train ({found or out.stderr[-500:]})")


def run_once(
    python: str, tree: pathlib.Path, suites: list[str], bench_args: list[str], out: pathlib.Path
) -> dict:
    cmd = [python, "-m", "fp8train.tools.bench", *suites, "--out", str(out), *bench_args]
    done = subprocess.run(cmd, env=_env(tree), cwd=out, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} in {tree} failed:\n{done.stderr[-3000:]}")
    return {suite: json.loads((out / f"{suite}.json").read_text()) for suite in suites}


def figures(results: dict) -> dict[str, float]:
    """{"suite | row | column": value} for every numeric (non-bool) figure of every row."""
    found = {}
    for suite, result in results.items():
        for row in result.get("rows", []):
            # a row is named by its text fields (a suite's configuration) and its thread count
            names = [k for k, v in row.items() if isinstance(v, str) or k == "threads"] or [next(iter(row))]
            label = ", ".join(f"{k}={row[k]}" for k in names)
            for column, value in row.items():
                if column not in names and isinstance(value, (int, float)) and not isinstance(value, bool):
                    found[f"{suite} | {label} | {column}"] = float(value)
    return found


def compare(runs: dict[str, list[dict[str, float]]]) -> list[dict]:
    before, after = runs["before"], runs["after"]
    if any(set(b) != set(a) for b, a in zip(before, after)):
        raise SystemExit("the two trees' suites report different rows or columns; compare them by hand")
    rows = []
    for name in before[0]:
        ratios = [a[name] / b[name] for b, a in zip(before, after) if b[name] != 0]
        rows.append(
            {
                "figure": name,
                "before": statistics.median(b[name] for b in before),
                "after": statistics.median(a[name] for a in after),
                "ratio": statistics.median(ratios) if ratios else None,
                "lowest": min(ratios, default=None),
                "highest": max(ratios, default=None),
            }
        )
    return rows


def render(rows: list[dict], repeats: int) -> str:
    width = max(len(r["figure"]) for r in rows)
    lines = [
        f"{'figure'.ljust(width)}  {'before':>10}  {'after':>10}  after/before (lowest-highest of {repeats})"
    ]
    for r in rows:
        spread = "" if r["ratio"] is None else f"{r['ratio']:.3f} ({r['lowest']:.3f}-{r['highest']:.3f})"
        lines.append(f"{r['figure'].ljust(width)}  {r['before']:>10.4g}  {r['after']:>10.4g}  {spread}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=pathlib.Path)
    parser.add_argument("after", type=pathlib.Path)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each tree (default 5)")
    parser.add_argument(
        "--suites", nargs="+", default=["fused", "step"], help="bench suites (default: fused step)"
    )
    parser.add_argument("--python", default=sys.executable, help="an interpreter with torch")
    parser.add_argument("--out", default=None, help="also save the comparison as JSON here")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for tree in trees.values():
        check_tree(args.python, tree)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in TREES}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.repeats):
            for name in TREES if i % 2 == 0 else TREES[::-1]:  # ABBA: drift in the load falls on both
                out = pathlib.Path(scratch) / f"{name}{i}"
                out.mkdir()
                runs[name].append(figures(run_once(args.python, trees[name], args.suites, bench_args, out)))
                print(f"repetition {i + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
    rows = compare(runs)
    print(f"before: {trees['before']}\nafter:  {trees['after']}")
    print(f"suites: {' '.join(args.suites)} {' '.join(bench_args)}; {args.repeats} repetitions, alternating")
    print(render(rows, args.repeats))
    if args.out:
        record = {
            "trees": {k: str(v) for k, v in trees.items()},
            "suites": args.suites,
            "bench_args": bench_args,
        }
        pathlib.Path(args.out).write_text(
            json.dumps({**record, "repeats": args.repeats, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
