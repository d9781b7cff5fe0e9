"""Per-step FP8 telemetry: amax, scale, range utilisation, overflow and non-finite events per tensor role.

Usage (see docs/telemetry.md)::

    tel = fp8train.telemetry.Telemetry(model, run_dir="runs/x", tensorboard=False)
    for step in range(steps):
        ...forward in fp8_autocast, backward, optimizer step...
        tel.log_step(step, loss=loss.detach())
    tel.close()

Nothing here waits for the device. A logged step gathers, per amax group (not per module), the
scale in effect during the step, the newest history row and the new scale into one device tensor
and starts a non-blocking copy of it to host memory; the record is completed from that copy at a
later logged step, once the copy has arrived (or at `flush`/`close`, which wait for it). So
`log_step` returns an earlier logged step's record: the previous one on a CPU, where copies arrive
at once. A `loss` passed as a tensor travels in the same copy.

Definitions, per role (e.g. "blocks.0.mlp/fc1/input"):
- ``amax``: the most recent reduced amax, i.e. ``amax_history[0]`` after this step's update.
- ``scale_used``: the scale the step's casts used; ``scale``: the new scale (used by the next step).
- ``util``: range utilisation ``amax * scale_used / fp8_max`` (1.0 = the full FP8 range).
- ``overflow``: ``amax * scale_used > fp8_max``, values beyond the representable range at the scale
  used that step (they were saturated by the cast).
- ``nonfinite``: the reduced amax is inf or NaN (a NaN on any rank arrives as +inf); the scale was kept.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .amax import HostMirror, roles
from .inspection import DirectionView, counters
from .layer_coverage import StepCoverage, coverage
from .modules.base import FP8Module

__all__ = ["Telemetry", "role_names", "read_metrics", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"
_DIRECTIONS = (
    ("scaling_fwd", roles.FWD_ROLES, roles.FWD_ROLE_NAMES),
    ("scaling_bwd", roles.BWD_ROLES, roles.BWD_ROLE_NAMES),
)


def role_names(model: torch.nn.Module) -> list[tuple[str, FP8Module, str, int]]:
    """(role name, module, "scaling_fwd"|"scaling_bwd", column within the module) for every cast role
    of the FP8 modules of `model`.

    Names come from each module's own GEMM names (`FP8Module.gemm_names`), so modules with several
    GEMMs get one name per GEMM."""
    out = []
    for mod_name, module in model.named_modules():
        if not isinstance(module, FP8Module):
            continue
        base = mod_name or type(module).__name__
        for g, gemm in enumerate(module.gemm_names):
            prefix = f"{base}/{gemm}" if gemm else base
            out += [
                (f"{prefix}/{role_name}", module, key, per_gemm * g + role)
                for key, per_gemm, names in _DIRECTIONS
                for role, role_name in names.items()
            ]
    return out


@dataclass
class _GroupView:
    """The roles of one amax group direction that belong to the model: storage columns and names."""

    direction: DirectionView
    columns: torch.Tensor  # int64 indices into the storage, on its device (which never changes)
    names: list[str]
    last_scale: Optional[torch.Tensor] = None  # scale of `columns` after the previous logged update


@dataclass
class _PendingRecord:
    """A logged step whose device values are on their way to the host."""

    record: dict  # everything known on the host at log time
    copy: Optional[HostMirror]
    views: list[_GroupView]  # whose values the copy holds, in order (3 per role)
    loss_on_device: bool  # the copy's last value is the loss
    statistics: list = ()  # names of the tensor statistics just before the loss in the copy


def _float32(x: float) -> float:
    """`x` rounded to float32 (a product of two float32 values is exact in a Python float first)."""
    return struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) else x


def _finite(x: float):
    """JSON has no inf/NaN: write them as strings ("inf", "-inf", "nan"); read_metrics turns them back."""
    return x if math.isfinite(x) else str(x)


class Telemetry:
    """Logs FP8 state and reduction statistics of `model` per step to JSON lines (and TensorBoard).

    Call `log_step` after each step's backward (and optimizer step); it returns an earlier logged
    step's record (see the module docstring), and `flush`/`close` complete the rest. `every=N`
    logs one step in N; other calls only cost a counter check. With `run_dir=None` nothing is
    written (records are still returned), which lets every rank run the same code while rank 0 writes.

    Args:
        model: the model whose FP8 modules are watched (prepared or converted).
        run_dir: the directory the records go to (`run_dir/file_name`; created), or None.
        every: log one step in `every` (>= 1).
        tensorboard: also write TensorBoard scalars under `run_dir/tensorboard/run` (needs tensorboard).
        run: the run's name (TensorBoard's subdirectory, and a field of each record).
        file_name: the JSON-lines file's name in `run_dir` (default `METRICS_FILE`).
        step_coverage: count what each logged step ran in FP8 (FLOPs, GEMM paths: forward hooks on
            the linear layers; layer_coverage.StepCoverage).
        statistics: a `fp8train.tensor_stats.GemmStatistics` whose per-GEMM statistics ride each
            record, or None.

    Raises:
        ValueError: `every` < 1.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        run_dir: Optional[str] = None,
        every: int = 1,
        tensorboard: bool = False,
        run: str = "fp8",
        file_name: str = METRICS_FILE,
        step_coverage: bool = True,
        statistics=None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.model = model
        self.every = every
        self.run = run
        self.views: list[_GroupView] = []
        self._registered = -1  # number of registered roles the views were built for
        self._roles: Optional[list] = None
        self._last_stats = counters()
        self._last_time = time.perf_counter()
        self._pending: collections.deque[_PendingRecord] = collections.deque()  # in step order
        self._spares: list[HostMirror] = []  # host buffers of completed records, for reuse
        self._file = None
        self._tb = None
        self.totals = {"overflow": 0, "nonfinite": 0}
        # what each logged step ran in FP8 (layer_coverage.py): counted from shapes, on the host
        self.step_coverage = StepCoverage(model) if step_coverage else None
        self.statistics = statistics  # a tensor_stats.GemmStatistics: its device values ride the copy
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(os.path.join(run_dir, file_name), "a", encoding="utf-8")
            if tensorboard:
                self._tb = _tensorboard_writer(os.path.join(run_dir, "tensorboard", run))

    # ---- the role map ---------------------------------------------------------------------------
    def _refresh_views(self) -> None:
        """(Re)build the per-group column maps when modules joined amax groups since the last log."""
        if self._roles is None:
            self._roles = role_names(self.model)
        if self._registered == len(self._roles):
            return  # every role has joined (for good: a module never leaves its group), the maps are final
        joined = [(n, m.fp8_meta[k], c) for n, m, k, c in self._roles if m.fp8_meta[k].direction is not None]
        if len(joined) == self._registered:
            return
        by_direction: dict[int, tuple[object, list[int], list[str]]] = {}
        for name, meta, col in joined:
            entry = by_direction.setdefault(id(meta.direction), (DirectionView(meta.direction), [], []))
            entry[1].append(meta.offset + col)
            entry[2].append(name)
        self.views = [
            _GroupView(
                direction, torch.tensor(cols, dtype=torch.long, device=direction.storage.device), names
            )
            for direction, cols, names in by_direction.values()
        ]
        self._registered = len(joined)

    # ---- logging ----------------------------------------------------------------------------------
    def log_step(self, step: int, loss=None, **extra) -> Optional[dict]:
        """Start logging step `step` (if it is one in `every`); complete the earlier logged steps whose
        values have reached the host, and return the latest of them (on a CPU, the previous one), or
        None. `loss`: the step's loss (a tensor is read when the record completes, not now); `extra`:
        more JSON-able fields for the record."""
        step_coverage = self.step_coverage.take() if self.step_coverage is not None else None
        if self.statistics is not None:  # the next step is measured only if it is logged
            self.statistics.arm_for(step + 1 if (step + 1) % self.every == 0 else None)
        if step % self.every:
            return None
        now = time.perf_counter()
        self._refresh_views()
        values = [self._device_values(view) for view in self.views]
        stat_names: list[str] = []
        if self.statistics is not None:
            stat_names, stat_values = self.statistics.take()
            if stat_values is not None:
                values.append(stat_values.to(values[0].device) if values else stat_values)
        if isinstance(loss, torch.Tensor):
            values.append(loss.detach().float().reshape(1).to(values[0].device if values else loss.device))
        copy = None
        if values:
            payload = torch.cat(values)
            spares = [m for m in self._spares if m.host.shape == payload.shape]
            copy = spares[0] if spares else HostMirror(payload)  # pinned memory: allocated a few times
            if spares:
                self._spares.remove(copy)
            copy.publish(payload)
        stats = counters()  # host counters only: nothing here waits
        record = {
            "kind": "step",
            "run": self.run,
            "step": step,
            "time_s": now - self._last_time,
            "loss": loss if not isinstance(loss, torch.Tensor) else None,
            "recipe": self._recipe_kind(),
            **extra,
            "reduction": stats,
            "reduction_delta": {k: stats[k] - self._last_stats[k] for k in stats},
        }
        if step_coverage is not None:  # this step's own GEMMs; amax collectives since the last log
            record["coverage"] = {**step_coverage, "amax_collectives": record["reduction_delta"]["launched"]}
        self._last_stats, self._last_time = stats, now
        arrived = self._complete_arrived(wait=False)
        pending = _PendingRecord(record, copy, list(self.views), isinstance(loss, torch.Tensor), stat_names)
        self._pending.append(pending)
        return arrived

    def _recipe_kind(self) -> Optional[str]:
        """The recipe kind the model's FP8 modules trained with ("delayed", "current", "block";
        "mixed" if they differ; None before any trained)."""
        kinds = {m.recipe_kind for m in self.model.modules() if isinstance(m, FP8Module)} - {None}
        return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else None)

    def flush(self) -> Optional[dict]:
        """Complete every logged step (waiting for their copies); return the last record."""
        return self._complete_arrived(wait=True)

    def _complete_arrived(self, wait: bool) -> Optional[dict]:
        """Complete pending records in order, as far as their copies have arrived (all, with `wait`)."""
        record = None
        while self._pending and (wait or self._pending[0].copy is None or self._pending[0].copy.ready()):
            record = self._complete(self._pending.popleft())
        return record

    def _device_values(self, view: _GroupView) -> torch.Tensor:
        """[scale used, newest amax, new scale] of the view's roles, as one device tensor."""
        direction = view.direction
        storage = direction.storage
        cols = view.columns
        # While this step's reductions are pending, the storage still holds the scale the step used:
        # only finish() writes it. If something already finished them, use the scale we saw last time.
        if direction.pending_reductions:
            used = storage.scale[cols]
        elif view.last_scale is not None:
            used = view.last_scale
        else:  # finished by someone else before the first log: the scale used is not known any more
            used = torch.full((len(view.names),), float("nan"), device=storage.device)
        direction.complete()
        view.last_scale = storage.scale[cols]
        return torch.stack([used, storage.history[0, cols], view.last_scale]).flatten()

    def _complete(self, pending: _PendingRecord) -> dict:
        record = pending.record
        values = pending.copy.wait().tolist() if pending.copy is not None else []  # arrived, or a flush
        if pending.copy is not None:
            self._spares.append(pending.copy)
        if pending.loss_on_device:
            record["loss"] = values.pop()
        if pending.statistics:
            n = len(pending.statistics)
            values, measured = values[:-n], values[-n:]
            record["statistics"] = _nested(pending.statistics, measured)
            self.statistics.check(record["statistics"])
        record["loss"] = None if record["loss"] is None else _finite(float(record["loss"]))
        roles: dict[str, dict] = {}
        events = {"overflow": 0, "nonfinite": 0}
        at = 0
        for view in pending.views:
            n = len(view.names)
            used_v, amax_v, scale_v = (values[at + i * n : at + (i + 1) * n] for i in range(3))
            at += 3 * n
            fp8_max = view.direction.fp8_max
            for name, used, amax, scale in zip(view.names, used_v, amax_v, scale_v):
                scaled = _float32(amax * used)  # in float32, as the cast computes x * scale
                nonfinite = not math.isfinite(amax)
                overflow = scaled > fp8_max and not nonfinite  # non-finite is its own event
                roles[name] = {
                    "amax": _finite(amax),
                    "scale": _finite(scale),
                    "scale_used": _finite(used),
                    "util": _finite(scaled / fp8_max),
                    "overflow": overflow,
                    "nonfinite": nonfinite,
                }
                events["overflow"] += overflow
                events["nonfinite"] += nonfinite
        record["events"], record["roles"] = events, roles
        for key in events:
            self.totals[key] += events[key]
        self.write(record)
        if self._tb is not None:
            self._tb_write(record)
        return record

    def write_coverage(self, recipe=None) -> dict:
        """Write the model's layer coverage (`fp8train.coverage(model, recipe)`) as a "coverage" record."""
        record = {**coverage(self.model, recipe).as_dict(), "run": self.run}
        self.write(record)
        return record

    def write(self, record: dict) -> None:
        """Append any JSON-able record (e.g. run metadata) to the metrics file."""
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()

    def _tb_write(self, record: dict) -> None:
        step = record["step"]
        if isinstance(record["loss"], float):
            self._tb.add_scalar("loss", record["loss"], step)
        self._tb.add_scalar(
            "reduction/exposed_wait_ms", 1e3 * record["reduction_delta"]["exposed_wait_s"], step
        )
        self._tb.add_scalar("reduction/hidden_ms", 1e3 * record["reduction_delta"]["hidden_s"], step)
        for name, values in record["roles"].items():
            for key in ("amax", "scale", "util"):
                if isinstance(values[key], float):
                    self._tb.add_scalar(f"{key}/{name}", values[key], step)

    def close(self) -> None:
        """Complete and write every pending record (`flush`), remove the hooks, close the files."""
        self.flush()
        if self.step_coverage is not None:
            self.step_coverage.remove()
        if self.statistics is not None:  # its hooks: it measures for this telemetry only
            self.statistics.remove()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensorboard_writer(log_dir: str):
    """A SummaryWriter, or None with a message when the tensorboard package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "fp8train.telemetry: TensorBoard logging was requested but the 'tensorboard' package is not "
            "installed (pip install tensorboard); writing JSON lines only.",
            file=sys.stderr,
        )
        return None
    return SummaryWriter(log_dir=log_dir)


def _nested(names: list[str], values: list[float]) -> dict:
    """{"layer/role": {statistic: value}} from "layer/role/statistic" names."""
    out: dict[str, dict] = {}
    for name, value in zip(names, values):
        where, _, key = name.rpartition("/")
        out.setdefault(where, {})[key] = _finite(value)
    return out


def _restore(value):
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {k: _restore(v) for k, v in value.items()}
    return value


def read_metrics(path: str) -> list[dict]:
    """The records of the metrics.jsonl file at `path`, "inf"/"nan" strings turned back into floats."""
    with open(path, encoding="utf-8") as f:
        return [_restore(json.loads(line)) for line in f if line.strip()]
