"""Streams and CUDA events on the CPU: which stream the FP8 state's device work runs on, on
which device its timing events are recorded, and that what is kept of them stays bounded.

The CUDA branches are taken with stand-ins: `StandInStreams` plays the streams of a device (which one
is current, who waited for whom), `SimulatedDevice` the CUDA events of a device that runs behind the
host (an event completes when the simulated device reaches it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import pytest
import torch

import fp8train
from fp8train.amax import reduction
from fp8train.amax.state import AMAX
from fp8train.amax.stats import HostMirror, Mark, ReductionStats
from multirank import run_ranks

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


class StandInStream:
    def __init__(self, name: str, device: Optional[torch.device] = None) -> None:
        self.name, self.device = name, device
        self.waited: list[str] = []  # names of the streams it was made to wait for, in order

    def wait_stream(self, other: StandInStream) -> None:
        self.waited.append(other.name)

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"


class StandInStreams:
    """The streams of a device: `current_stream` and `use_stream` as streams.py has them on CUDA."""

    def __init__(self) -> None:
        self.compute = StandInStream("compute")
        self.current = self.compute

    def current_stream(self, device: torch.device) -> StandInStream:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: StandInStream):
        caller, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = caller


def _install(streams: StandInStreams, inside: list, patch=setattr) -> list[tuple[bool, str]]:
    """Streams on the CPU: fp8train's stream choices then run as on CUDA (a forced branch; before
    streams.py existed, nothing in fp8train asked for a stream). Returns (inside FSDP2's all-gather,
    the current stream) of every fused update fp8train runs from then on."""
    # torch's stream queries are facts of a CUDA device, which no setting may answer: stand-ins here
    module = sys.modules.get("fp8train.amax.streams")
    if module is not None:
        patch(module, "current_stream", streams.current_stream)
        patch(module, "use_stream", streams.use_stream)
    seen: list[tuple[bool, str]] = []
    update = reduction.update_scaling

    def spy(*args, **kwargs):
        seen.append((bool(inside), streams.current.name))
        return update(*args, **kwargs)

    patch(reduction, "update_scaling", spy)
    return seen


# ---- the stream guard ----------------------------------------------------------------------------------
def test_finish_on_another_stream_runs_on_the_launch_stream(monkeypatch) -> None:
    """A reduction launched on the compute stream and finished from a side stream: its wait and update
    are queued on the compute stream, and the side stream waits for them; finished from the compute
    stream, nothing is switched and nothing waits."""
    streams = StandInStreams()
    updates = _install(streams, [], monkeypatch.setattr)
    model = fp8train.Linear(16, 16)
    for _ in range(2):
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(torch.randn(8, 16)).sum().backward()
    fp8train.synchronize()  # on the compute stream
    assert updates and all(on == "compute" for _, on in updates) and streams.compute.waited == []
    del updates[:]
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        model(torch.randn(8, 16))  # launches a forward reduction at exit
    side = streams.current = StandInStream("side")
    fp8train.synchronize()
    assert [on for _, on in updates] == ["compute"] and side.waited == ["compute"]
    assert streams.current is side  # the caller's stream is current again


def _train_under_fsdp2(rank: int, world: int) -> dict:
    """FSDP2 with fsdp_fp8_all_gather, on stand-in streams: FSDP2's all-gather runs on its copy-in
    stream (as `foreach_all_gather` does on CUDA); which stream each update ran on."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    streams = StandInStreams()
    copy_in = StandInStream("copy-in")
    inside: list = []
    updates = _install(streams, inside)
    gather = _fsdp_param_group.foreach_all_gather

    def on_copy_in_stream(*args, **kwargs):
        caller, streams.current = streams.current, copy_in
        inside.append(True)
        try:
            return gather(*args, **kwargs)
        finally:
            streams.current = caller
            inside.pop()

    _fsdp_param_group.foreach_all_gather = on_copy_in_stream
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        fp8train.Linear(32, 32, fsdp_fp8_all_gather=True), fp8train.Linear(32, 16, fsdp_fp8_all_gather=True)
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    for step in range(4):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + step))
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            y = model(x)
        y.square().mean().backward()
    fp8train.synchronize()
    return {"updates": updates, "copy_in_waited": copy_in.waited}


@pytest.mark.multirank
def test_no_finish_runs_on_fsdp2_copy_in_stream() -> None:
    """With fsdp_fp8_all_gather, FSDP2 asks for a weight's scale inside its all-gather: the forward
    reductions are finished there. Their updates must still run on the compute stream (which owns the
    reduced buffer), and the copy-in stream must wait for them before it casts with the new scales."""
    for out in run_ranks(_train_under_fsdp2, 2, timeout_s=180, pg_timeout_s=60):
        inside = [on for within, on in out["updates"] if within]
        assert inside, out  # the scenario is real: forward finishes ran inside the all-gather
        assert all(on == "compute" for _, on in out["updates"]), out["updates"]
        assert out["copy_in_waited"] == ["compute"] * len(inside)


# ---- timing events: on the FP8 state's device, and bounded -------------------------------------------
class SimulatedDevice:
    """CUDA events of one device that runs behind the host: `record` queues an event 1 ms after the
    previous one; it completes when `reached` passes it (or at `synchronize`)."""

    def __init__(self) -> None:
        self.recorded = 0
        self.reached = 0
        self.synchronized = 0  # calls of event.synchronize(): the host waited

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at, self.stream = None, None

            def record(self, stream=None) -> None:
                device.recorded += 1
                self.at, self.stream = device.recorded, stream

            def query(self) -> bool:
                return self.at <= device.reached

            def synchronize(self) -> None:
                device.synchronized += 1
                device.reached = max(device.reached, self.at)

            def elapsed_time(self, end) -> float:
                assert self.query() and end.query(), "elapsed_time of an event not completed"
                return float(end.at - self.at)

        return Event


@pytest.fixture
def simulated_cuda(monkeypatch) -> SimulatedDevice:
    device = SimulatedDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream("current", device))
    return device


def test_timing_events_are_recorded_on_the_fp8_states_device(simulated_cuda) -> None:
    """A rank whose FP8 state is on cuda:1 without torch.cuda.set_device: its events and its host
    mirrors' events go on cuda:1's stream, not the current device's (cuda:0)."""
    cuda1 = torch.device("cuda", 1)
    mark = Mark.now(cuda1)
    assert mark.event.stream is not None and mark.event.stream.device == cuda1
    mirror = HostMirror(torch.zeros(()))
    mirror.device, mirror.event = cuda1, torch.cuda.Event()  # a mirror of a value on cuda:1
    mirror.publish(torch.ones(()))
    assert mirror.event.stream is not None and mirror.event.stream.device == cuda1


def _reduce(stats: ReductionStats, device: torch.device) -> None:
    """One reduction's marks, as Direction records them: launched, then its wait's start and end."""
    launched = Mark.now(device)
    start = Mark.now(device)
    stats.add_interval("hidden_s", launched, start)
    stats.add_interval("exposed_wait_s", start, Mark.now(device))


def test_cuda_timings_stay_bounded_without_telemetry(simulated_cuda) -> None:
    """1,000 steps of 2 reductions each, the device 3 steps behind the host, nothing reading the
    counters: only the intervals the device has not completed are held, and none is lost."""
    stats, cuda, lag, steps = ReductionStats(), torch.device("cuda", 0), 3, 1000
    held = 0
    for _ in range(steps):
        for _direction in ("fwd", "bwd"):
            _reduce(stats, cuda)
        simulated_cuda.reached = max(0, simulated_cuda.recorded - lag * 6)  # 6 events per step
        held = max(held, len(stats._intervals))
    assert held <= 4 * (lag + 1)  # 4 intervals per step (it was 4,000 at the end)
    assert simulated_cuda.synchronized == 0  # folding never waits
    counters = stats.as_dict()  # a host point: waits for the rest
    assert counters["hidden_s"] == pytest.approx(2 * steps * 1e-3, rel=1e-9)
    assert counters["exposed_wait_s"] == pytest.approx(2 * steps * 1e-3, rel=1e-9)
    assert len(stats._intervals) == 0


def test_reduction_stats_without_completing_waits_for_nothing(simulated_cuda) -> None:
    """`reduction_stats(complete=False)` leaves the timings the device has not completed for later;
    the default waits for them."""
    _reduce(AMAX.stats, torch.device("cuda", 0))
    assert fp8train.reduction_stats(complete=False)["exposed_wait_s"] == 0.0
    assert simulated_cuda.synchronized == 0
    assert fp8train.reduction_stats()["exposed_wait_s"] == pytest.approx(1e-3)
    assert simulated_cuda.synchronized > 0
