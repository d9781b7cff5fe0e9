"""The global amax reduction on real gloo ranks: agreement, reference, skew, modes, errors.

Every rank feeds different data (seeded and scaled by rank), so local amaxes differ and only a
correct MAX reduction makes the ranks agree. Each rank also measures its own local amaxes with
module hooks; the test process MAX-reduces them itself and replays them through the per-column
reference of docs/design.md, section 1 (tests/reference.py), which every rank's state must equal bit for bit.

Two ways to read the state after a step:
- "public": through `fp8_meta[...]` (which first completes in-flight reductions): state after the
  step's own update, S_t.
- "raw": the group's storage as it is, reductions left in flight: the forward and backward updates of
  step t-1 ran inside step t (wait before read), so the state is S_{t-1}.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8train
from fp8train import DelayedScaling, LayoutMismatchError
from fp8train.amax import settings
from fp8train.amax.header import HEADER_LEN
from fp8train.amax.reduction import Direction
from multirank import AllReduceSpy, run_ranks, run_scenarios, scenario_outcome
from reference import E4M3_MAX, E5M2_MAX, RefScaling, amax_of

ENV_ASYNC = "NVTE_ASYNC_AMAX_REDUCTION"  # the documented variable (README)

WIDTH, BATCH, HISTORY = 16, 8, 4
RECIPE = DelayedScaling(amax_history_len=HISTORY)
SKEW_S = 0.03
LR = 0.05


# ---- a small model whose local amaxes the test measures itself --------------------------------------
class Net(torch.nn.Module):
    """A stack of fp8train.Linear with GELU between; can skip a layer or fail after one."""

    def __init__(self, layers: int = 2, width: int = WIDTH, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(fp8train.Linear(width, width) for _ in range(layers))
        self.skip: set[int] = set()
        self.fail_after: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            x = layer(x)
            if i == self.fail_after:
                raise RuntimeError(f"injected failure after layer {i}")
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def _amax(x: torch.Tensor) -> float:
    value = amax_of(x)
    return math.inf if math.isnan(value) else value  # the library reduces NaN as +inf


class LocalAmaxes:
    """This rank's amaxes per step, measured by hooks, in the library's column order.

    Forward columns per layer: input, weight, output (unused: 0); backward: grad_output, grad_input (0).
    """

    def __init__(self, model: Net) -> None:
        self.n = len(model.layers)
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(self._pre_hook(i))
            layer.register_forward_hook(self._post_hook(i))

    def start_step(self) -> None:
        self.fwd, self.bwd = [0.0] * (3 * self.n), [0.0] * (2 * self.n)

    def _pre_hook(self, i: int):
        def hook(layer, args):
            if torch.is_grad_enabled():
                self.fwd[3 * i] = _amax(args[0])
                self.fwd[3 * i + 1] = _amax(layer.weight)

        return hook

    def _post_hook(self, i: int):
        def hook(layer, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: self.bwd.__setitem__(2 * i, _amax(g)))

        return hook


def batch(rank: int, step: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (input, target) of a step: seeded by rank and step, input scaled by rank."""
    g = torch.Generator().manual_seed(1009 * rank + step)
    x = torch.randn(BATCH, width, generator=g) * (1.0 + rank) * (1.0 + 0.25 * (step % 3))
    return x, torch.randn(BATCH, width, generator=g)


def snapshot(model: Net, public: bool) -> dict:
    """fwd/bwd (history rows, scale, scale_inv) of the model's columns, as plain lists."""
    state = {}
    for key, name in (("scaling_fwd", "fwd"), ("scaling_bwd", "bwd")):
        if public:
            metas = [layer.fp8_meta[key] for layer in model.layers]
            history = torch.cat([m.amax_history for m in metas], dim=1)
            scale = torch.cat([m.scale for m in metas])
            scale_inv = torch.cat([m.scale_inv for m in metas])
        else:  # no finish: whatever the protocol has applied so far
            storage = model.layers[0].fp8_meta[key].direction.storage
            history, scale, scale_inv = storage.history, storage.scale, storage.scale_inv
        state[name] = (history.tolist(), scale.tolist(), scale_inv.tolist())
    return state


class Trainer:
    """One model and its plain-SGD update on one rank; `step` runs a training step and logs it."""

    def __init__(self, rank: int, group=None, recipe: DelayedScaling = RECIPE, layers: int = 2, **kw) -> None:
        self.rank, self.group, self.recipe = rank, group, recipe
        self.model = Net(layers, **kw)
        self.amaxes = LocalAmaxes(self.model)
        self.log = {"loss": [], "state": [], "local": [], "calls": [], "inflight": []}

    def step(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        sleep_fwd: float = 0.0,
        sleep_bwd: float = 0.0,
        spy: Optional[AllReduceSpy] = None,
        read: Optional[str] = "raw",
    ) -> float:
        self.amaxes.start_step()
        calls0 = spy.calls if spy else 0
        works0 = len(spy.works) if spy else 0
        if sleep_fwd:
            time.sleep(sleep_fwd)
        with fp8train.fp8_autocast(fp8_recipe=self.recipe, fp8_group=self.group):
            y = self.model(x)
        calls1 = spy.calls if spy else 0
        # collectives this region's forward launched that are still in flight at its exit
        inflight = sum(not w.done for w in spy.works[works0:]) if spy else 0
        loss = F.mse_loss(y.float(), target)
        if sleep_bwd:
            time.sleep(sleep_bwd)
        loss.backward()
        calls2 = spy.calls if spy else 0
        value = loss.item()
        with torch.no_grad():  # plain SGD (torch.optim's first use costs seconds of imports per rank)
            for p in self.model.parameters():
                if p.grad is not None and math.isfinite(value):  # a non-finite step is skipped
                    p -= LR * p.grad
                p.grad = None
        self.log["loss"].append(value)
        self.log["local"].append((list(self.amaxes.fwd), list(self.amaxes.bwd)))
        self.log["calls"].append((calls1 - calls0, calls2 - calls1))
        self.log["inflight"].append(inflight)
        if read is not None:
            self.log["state"].append(snapshot(self.model, public=read == "public"))
        return value

    def finish(self) -> dict:
        fp8train.synchronize()
        self.log["final"] = snapshot(self.model, public=False)
        self.log["stats"] = fp8train.reduction_stats()
        return self.log


def skew_sleeps(rank: int, world: int, step: int, skew: bool) -> tuple[float, float]:
    """The last rank sleeps before its forward on some steps and before its backward on others."""
    if not skew or rank != world - 1:
        return 0.0, 0.0
    return (SKEW_S if step % 3 == 1 else 0.0), (SKEW_S if step % 3 == 2 else 0.0)


def subgroup(groups: Optional[list[list[int]]], rank: int):
    """Create every listed group (all ranks must, in the same order); return the one holding `rank`."""
    if groups is None:
        return None
    made = [(members, dist.new_group(members)) for members in groups]
    return next(g for members, g in made if rank in members)


# ---- the independent reference ----------------------------------------------------------------------
def reference_states(logs: list[dict], recipe: DelayedScaling = RECIPE) -> tuple[list[dict], list[tuple]]:
    """S_t after each step from the MAX over `logs`' local amaxes; also the reduced vectors per step."""
    steps = len(logs[0]["local"])
    n_fwd, n_bwd = len(logs[0]["local"][0][0]), len(logs[0]["local"][0][1])
    fwd, bwd = RefScaling(n_fwd, recipe.amax_history_len), RefScaling(n_bwd, recipe.amax_history_len)
    states, reduced = [], []
    for t in range(steps):
        last_fwd = [max(log["local"][t][0][c] for log in logs) for c in range(n_fwd)]
        last_bwd = [max(log["local"][t][1][c] for log in logs) for c in range(n_bwd)]
        fwd.update(last_fwd, recipe, E4M3_MAX)
        bwd.update(last_bwd, recipe, E5M2_MAX)
        reduced.append((last_fwd, last_bwd))
        states.append(
            {
                ref_name: (ref.history_tensor().tolist(), list(ref.scale), list(ref.scale_inv))
                for ref_name, ref in (("fwd", fwd), ("bwd", bwd))
            }
        )
    return states, reduced


def initial_state(log: dict) -> dict:
    n_fwd, n_bwd = len(log["local"][0][0]), len(log["local"][0][1])
    return {
        name: ([[0.0] * n] * HISTORY, [1.0] * n, [1.0] * n) for name, n in (("fwd", n_fwd), ("bwd", n_bwd))
    }


def expected_per_step(log: dict, states: list[dict], read: str) -> list[dict]:
    return states if read == "public" else [initial_state(log)] + states[:-1]


def cross_rank_differences(logs: list[dict], ranks: list[int]) -> list[str]:
    """Where any rank's per-step state, or final state, differs from the first rank's."""
    diffs = []
    first = logs[ranks[0]]
    for r in ranks[1:]:
        if len(first["state"]) != len(logs[r]["state"]):
            diffs.append(f"ranks {ranks[0]} and {r} logged different numbers of steps")
        for t, (a, b) in enumerate(zip(first["state"], logs[r]["state"])):
            diffs += [f"step {t} {d}: ranks {ranks[0]} and {r} differ" for d in a if a[d] != b[d]]
        diffs += [
            f"final {d}: ranks {ranks[0]} and {r} differ"
            for d in first["final"]
            if first["final"][d] != logs[r]["final"][d]
        ]
    return diffs


def reference_differences(logs: list[dict], ranks: list[int], read: str) -> list[str]:
    states, _ = reference_states([logs[r] for r in ranks])
    diffs = []
    for r in ranks:
        expected = expected_per_step(logs[r], states, read)
        if len(expected) != len(logs[r]["state"]):
            diffs.append(f"rank {r} logged {len(logs[r]['state'])} states for {len(expected)} steps")
        for t, (got, want) in enumerate(zip(logs[r]["state"], expected)):
            diffs += [
                f"rank {r} step {t} {d}: {got[d]} != reference {want[d]}" for d in want if got[d] != want[d]
            ]
        diffs += [f"rank {r} final {d}" for d in states[-1] if logs[r]["final"][d] != states[-1][d]]
    return diffs


def assert_agree_with_reference(logs: list[dict], ranks: list[int], read: str) -> None:
    assert not cross_rank_differences(logs, ranks)
    diffs = reference_differences(logs, ranks, read)
    assert not diffs, "\n".join(diffs[:5])
    # the test is only meaningful if the ranks' local amaxes differ and the scales moved
    if len(ranks) > 1:
        assert any(logs[ranks[0]]["local"][t] != logs[r]["local"][t] for r in ranks[1:] for t in range(2))
    assert logs[ranks[0]]["final"]["fwd"][1] != initial_state(logs[ranks[0]])["fwd"][1]


# ---- scenarios: each runs inside every rank, with a fresh registry and its own amax group -------------
def _read_before_wait(self: Direction, pending) -> None:
    """The bug this project exists to avoid: take the amaxes out of the buffer, then wait."""
    early = [t.clone() for t in (pending.buffer, pending.extra) if t is not None]
    _read_before_wait.original(self, pending)
    for t, values in zip([t for t in (pending.buffer, pending.extra) if t is not None], early):
        t.copy_(values)  # what the update then reads: this rank's own values


_read_before_wait.original = Direction._wait


def _agreement(
    rank: int,
    world: int,
    steps: int,
    groups: Optional[list[list[int]]] = None,
    skew: bool = False,
    defer: bool = False,
    read: str = "raw",
    buggy: bool = False,
) -> dict:
    """Train `steps` steps and log every step's state; `groups=None` uses the default group (the world)."""
    trainer = Trainer(rank, subgroup(groups, rank))
    with AllReduceSpy(defer=defer) as spy:
        if buggy:  # a planted bug (read before the wait): no seam may make the library read early
            Direction._wait = _read_before_wait
        try:
            for t in range(steps):
                sleep_fwd, sleep_bwd = skew_sleeps(rank, world, t, skew)
                trainer.step(*batch(rank, t), sleep_fwd, sleep_bwd, spy=spy, read=read)
            return trainer.finish()
        finally:
            Direction._wait = _read_before_wait.original


def _modes(rank: int, world: int, steps: int) -> dict:
    """The same skewed training in async, blocking, and alternating (changed between steps) modes."""
    out = {}
    with AllReduceSpy() as spy:
        for name in ("async", "blocking", "alternating"):
            trainer = Trainer(rank, dist.new_group(list(range(world))))
            for t in range(steps):
                if name == "alternating":  # read at each region entry: a change between steps takes effect
                    os.environ[ENV_ASYNC] = "1" if t % 2 == 0 else "0"
                else:
                    os.environ[ENV_ASYNC] = "1" if name == "async" else "0"
                sleep_fwd, sleep_bwd = skew_sleeps(rank, world, t, True)
                trainer.step(*batch(rank, t), sleep_fwd / 3, sleep_bwd / 3, spy=spy)
            out[name] = trainer.finish()
    return out


def _count(rank: int, world: int, layer_counts: list[int], steps: int) -> dict:
    """Collectives per step and direction for n modules; then groups that reduce nothing."""
    out = {}
    with AllReduceSpy() as spy:
        for n, capacity in [(n, settings.initial_wire) for n in layer_counts] + [(layer_counts[-1], 16)]:
            with settings.override(initial_wire=capacity):  # read by the new channel
                trainer = Trainer(rank, dist.new_group(list(range(world))), layers=n, width=8)
                for t in range(steps):
                    trainer.step(*batch(rank, t, width=8), spy=spy, read=None)
            out[f"layers={n}, capacity={capacity}"] = trainer.finish()["calls"]
        single = [dist.new_group([r]) for r in range(world)]
        fp8train.reset_reduction_stats()
        local_runs = {
            "own single-rank group": Trainer(rank, single[rank]),
            "reduce_amax=False": Trainer(
                rank, None, DelayedScaling(amax_history_len=HISTORY, reduce_amax=False)
            ),
        }
        for name, trainer in local_runs.items():
            for t in range(steps):
                trainer.step(*batch(rank, t), spy=spy)
            out[name] = trainer.finish()
    return out


def _one_rank_world(rank: int, world: int, steps: int) -> dict:
    trainer = Trainer(rank)
    with AllReduceSpy() as spy:
        for t in range(steps):
            trainer.step(*batch(rank, t), spy=spy)
        return trainer.finish()


NAN_STEP, INF_STEP = 2, 7  # HISTORY=4: the NaN's +inf leaves the history at update NAN_STEP + 4


def _nonfinite(rank: int, world: int, steps: int) -> dict:
    trainer = Trainer(rank, dist.new_group(list(range(world))))
    for t in range(steps):
        x, target = batch(rank, t)
        if rank == 1 and t == NAN_STEP:
            x[0, 0] = math.nan
        if rank == 1 and t == INF_STEP:
            x[1, 1] = math.inf
        trainer.step(x, target, read="public")
    return trainer.finish()


def _layout(rank: int, world: int) -> dict:
    out = {}
    # (a) rank 1 has an extra module: the first header disagrees, raised two launches later
    trainer = Trainer(rank, dist.new_group(list(range(world))), layers=3 if rank == 1 else 2)
    out["extra module"] = _until_mismatch(trainer, rank, steps=3, skip_at=None)
    # (b) same model, but rank 1 skips its second layer on step 2
    trainer = Trainer(rank, dist.new_group(list(range(world))))
    out["skipped module"] = _until_mismatch(trainer, rank, steps=5, skip_at=2)
    return out


def _until_mismatch(trainer: Trainer, rank: int, steps: int, skip_at: Optional[int]) -> dict:
    for t in range(steps):
        trainer.model.skip = {1} if (rank == 1 and t == skip_at) else set()
        try:
            trainer.step(*batch(rank, t))
        except LayoutMismatchError as err:
            now = snapshot(trainer.model, public=False)
            return {"step": t, "message": str(err), "states": trainer.log["state"], "now": now}
    return {"step": None}


FAIL_STEP = 3


def _exception_run(rank: int, group, fail: bool, steps: int = 6) -> dict:
    trainer = Trainer(rank, group, layers=3)
    for t in range(steps):
        if fail and t == FAIL_STEP:
            # layer 0 records (larger) amaxes, then the forward raises: nothing of it may remain
            trainer.model.fail_after = 0
            x, target = batch(rank, t)
            with pytest.raises(RuntimeError, match="injected failure"):
                trainer.step(x * 100, target)
            trainer.model.fail_after = None
            assert fp8train.inspection.open_regions() == 0 and fp8train.inspection.current_region() is None
            for key in trainer.log:  # forget the failed attempt's partial log entries, if any
                trainer.log[key] = trainer.log[key][:t]
        trainer.step(*batch(rank, t), read="public")
    return trainer.finish()


def _exception(rank: int, world: int) -> tuple[dict, dict]:
    clean = _exception_run(rank, dist.new_group(list(range(world))), fail=False)
    failed = _exception_run(rank, dist.new_group(list(range(world))), fail=True)
    return clean, failed


LATENCY_S = 0.05


def _stats(rank: int, world: int, steps: int) -> dict:
    """Steady-state statistics of both modes with LATENCY_S added to each amax collective."""
    out = {}
    for name, env in (("async", "1"), ("blocking", "0")):
        os.environ[ENV_ASYNC] = env
        trainer = Trainer(rank, dist.new_group(list(range(world))))
        with AllReduceSpy(latency_s=LATENCY_S) as spy:
            for t in range(steps):
                if t == 1:
                    fp8train.reset_reduction_stats()  # the first step settles the layout
                trainer.step(*batch(rank, t), spy=spy, read=None)
                time.sleep(LATENCY_S)  # optimizer / data loading: the time async hides the collective in
            fp8train.synchronize()
            out[name] = fp8train.reduction_stats()
    return out


SCENARIOS = {
    "default group, public reads": lambda rank, world: _agreement(rank, world, 6, read="public"),
    "default group, raw reads": lambda rank, world: _agreement(rank, world, 6, read="raw"),
    "skew": lambda rank, world: _agreement(rank, world, 8, [list(range(world))], skew=True),
    "skew deferred": lambda rank, world: _agreement(rank, world, 8, [list(range(world))], True, True),
    "read before wait": lambda rank, world: _agreement(rank, world, 4, [[0, 1]], True, True, buggy=True),
    "modes": lambda rank, world: _modes(rank, world, 50),
    "count": lambda rank, world: _count(rank, world, [4, 64], 4),
    "nonfinite": lambda rank, world: _nonfinite(rank, world, 10),
    "exception": _exception,
    "stats": lambda rank, world: _stats(rank, world, 4),
    "subgroups": lambda rank, world: _agreement(rank, world, 6, [[0, 2], [1, 3]]),
    "layout": _layout,
    "one-rank world": lambda rank, world: _one_rank_world(rank, world, 3),
}


def _worker(rank: int, world: int, names: list[str]) -> dict:
    """Run the named scenarios in order; each starts from a fresh registry and default env."""

    def run_one(name: str):
        fp8train.inspection.reset()
        os.environ.pop(ENV_ASYNC, None)
        return SCENARIOS[name](rank, world)

    return run_scenarios(names, run_one)


outcome = scenario_outcome


# One process group per world size for the whole module: spawning ranks costs seconds on 2 cores.
@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    names = ["default group, public reads", "skew", "skew deferred", "read before wait", "modes", "count"]
    names += ["nonfinite", "exception", "stats"]
    return run_ranks(_worker, 2, names, timeout_s=180, pg_timeout_s=30)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_worker, 4, ["default group, raw reads", "subgroups"], timeout_s=120, pg_timeout_s=30)


# ---- agreement with the reference ---------------------------------------------------------------------
@pytest.mark.multirank
def test_two_ranks_agree_with_reference(two_ranks):
    assert_agree_with_reference(outcome(two_ranks, "default group, public reads"), [0, 1], "public")


@pytest.mark.multirank
def test_four_ranks_agree_with_reference(four_ranks):
    assert_agree_with_reference(outcome(four_ranks, "default group, raw reads"), [0, 1, 2, 3], "raw")


@pytest.mark.multirank
def test_subgroups_of_four_ranks_agree_with_reference(four_ranks):
    logs = outcome(four_ranks, "subgroups")
    assert_agree_with_reference(logs, [0, 2], "raw")
    assert_agree_with_reference(logs, [1, 3], "raw")
    assert logs[0]["final"] != logs[1]["final"]  # two separate amax groups, not the world


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["skew", "skew deferred"])
def test_skewed_ranks_agree_every_step(two_ranks, name):
    logs = outcome(two_ranks, name)
    assert_agree_with_reference(logs, [0, 1], "raw")
    # every region's forward reduction was still outstanding when the rank went on with its step
    assert all(n > 0 for log in logs for n in log["inflight"])


@pytest.mark.multirank
def test_the_check_catches_read_before_wait(two_ranks):
    """The same check, run on an implementation that reads the buffer before waiting, must fail."""
    logs = outcome(two_ranks, "read before wait")
    diffs = cross_rank_differences(logs, [0, 1])
    assert any(d.startswith("step 1 ") for d in diffs), diffs  # step 0's update, applied in step 1
    assert reference_differences(logs, [0, 1], "raw")


# ---- async vs blocking -----------------------------------------------------------------------------------
@pytest.mark.multirank
def test_async_and_blocking_are_bit_identical(two_ranks):
    runs = outcome(two_ranks, "modes")
    steps = len(runs[0]["async"]["loss"])
    for rank_runs in runs:
        a, b, c = rank_runs["async"], rank_runs["blocking"], rank_runs["alternating"]
        for other in (b, c):
            assert other["loss"] == a["loss"]
            assert other["state"] == a["state"]
            assert other["final"] == a["final"]
        assert all(math.isfinite(v) for v in a["loss"])
        # the mode really differed: async leaves the forward reduction in flight at region exit
        assert a["inflight"] == [1] * steps
        assert b["inflight"] == [0] * steps
        assert c["inflight"] == [1 - t % 2 for t in range(steps)]
    assert_agree_with_reference([r["async"] for r in runs], [0, 1], "raw")


# ---- collective count ------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_one_collective_per_region_and_direction(two_ranks):
    runs = outcome(two_ranks, "count")
    for rank_runs in runs:
        for n in (4, 64):  # every collective carries INITIAL_WIRE amaxes: one per direction, always
            calls = rank_runs[f"layers={n}, capacity={settings.initial_wire}"]
            assert calls == [(1, 1)] * len(calls), (n, calls)
        # 64 modules need more than 16 values: in the first step a blocking handshake settles the new
        # size of every collective on the process group, then the amaxes (reduction.py, "The layout
        # grew"); the backward's fewer roles fit that size. Afterwards exactly one per direction
        calls = rank_runs["layers=64, capacity=16"]
        assert calls[0] == (2, 1), calls
        assert calls[1:] == [(1, 1)] * (len(calls) - 1), calls
    for name in ("own single-rank group", "reduce_amax=False"):
        logs = [rank_runs[name] for rank_runs in runs]
        for log in logs:
            assert log["calls"] == [(0, 0)] * len(log["calls"]), name
            assert log["stats"]["launched"] == 0
            assert_agree_with_reference([log], [0], "raw")  # each rank scales from its own amaxes
        assert logs[0]["final"] != logs[1]["final"], name


@pytest.mark.multirank
def test_no_collective_in_a_one_rank_world():
    (run,) = run_ranks(_worker, 1, ["one-rank world"], timeout_s=60, pg_timeout_s=20)
    (log,) = outcome([run], "one-rank world")
    assert log["calls"] == [(0, 0)] * 3
    assert log["stats"]["launched"] == 0
    assert_agree_with_reference([log], [0], "raw")


# ---- non-finite amaxes -----------------------------------------------------------------------------------
@pytest.mark.multirank
def test_nonfinite_amax_on_one_rank_keeps_scales_on_all(two_ranks):
    logs = outcome(two_ranks, "nonfinite")
    steps = len(logs[0]["loss"])
    assert_agree_with_reference(logs, [0, 1], "public")
    _, reduced = reference_states(logs)
    assert reduced[NAN_STEP][0][0] == reduced[INF_STEP][0][0] == math.inf  # reached every rank as +inf
    kept = [*range(NAN_STEP, NAN_STEP + HISTORY), *range(INF_STEP, steps)]
    for log in logs:
        # input role of layer 0: the previous (finite) scale stays while +inf is in its history
        scale0 = [state["fwd"][1][0] for state in log["state"]]
        assert all(scale0[t] == scale0[t - 1] for t in kept)
        # ... and moves again once it left: training continued
        assert scale0[NAN_STEP + HISTORY] != scale0[NAN_STEP + HISTORY - 1]
        for state in log["state"]:
            assert all(math.isfinite(s) and s > 0 for d in ("fwd", "bwd") for s in state[d][1])
        expected_events = sum(math.isinf(v) for fwd, bwd in reduced for v in fwd + bwd)
        assert log["stats"]["nonfinite_amax_events"] == expected_events > 0
    assert not math.isfinite(logs[1]["loss"][NAN_STEP])
    finite = [v for r, log in enumerate(logs) for t, v in enumerate(log["loss"]) if (r, t) != (1, NAN_STEP)]
    assert all(math.isfinite(v) for v in finite)


# ---- layout mismatch -------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_layout_mismatch_raises_on_every_rank():
    runs = run_ranks(_worker, 2, ["layout"], timeout_s=60, pg_timeout_s=20)
    for rank, out in enumerate(outcome(runs, "layout")):
        extra = out["extra module"]
        assert extra["step"] == 1  # at the second step's region exit, on every rank
        assert "roles: this rank" in extra["message"] and "group min 6 max 9" in extra["message"]
        assert extra["now"]["fwd"][1] == [1.0] * (9 if rank == 1 else 6)  # nothing applied
        skipped = out["skipped module"]
        assert skipped["step"] == 3  # the step after the mismatch, when its amaxes are first needed
        assert "roles_recorded" in skipped["message"] and "group min 2 max 4" in skipped["message"]
        assert skipped["now"] == skipped["states"][-1]  # the state at the end of step 2: nothing applied


# ---- an exception inside a region ------------------------------------------------------------------------
def _assert_same_run(a: dict, b: dict) -> None:
    assert b["loss"] == a["loss"]
    assert b["state"] == a["state"]
    assert b["final"] == a["final"]


def test_exception_in_region_single_process():
    clean = _exception_run(0, None, fail=False)
    fp8train.inspection.reset()  # a fresh amax group for the second run
    failed = _exception_run(0, None, fail=True)
    _assert_same_run(clean, failed)


@pytest.mark.multirank
def test_exception_in_region_on_both_ranks(two_ranks):
    runs = outcome(two_ranks, "exception")
    for clean, failed in runs:
        _assert_same_run(clean, failed)
    assert_agree_with_reference([failed for _, failed in runs], [0, 1], "public")


# ---- statistics ------------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_reduction_stats_with_injected_latency(two_ranks):
    steady = 4 - 1
    launched = 2 * steady
    # every collective on a process group has one size, INITIAL_WIRE amaxes after the header
    bytes_per_step = 4 * (2 * HEADER_LEN + 2 * settings.initial_wire)  # float32, both directions
    for rank_runs in outcome(two_ranks, "stats"):
        for stats in rank_runs.values():
            assert stats["launched"] == launched
            assert stats["bytes_reduced"] == bytes_per_step * steady
        a, b = rank_runs["async"], rank_runs["blocking"]
        # blocking: every collective waits out its full latency, and nothing is hidden
        assert b["exposed_wait_s"] >= LATENCY_S * launched
        assert b["hidden_s"] == 0.0
        # async: each collective was launched at least LATENCY_S before anything waited on it
        assert a["hidden_s"] >= LATENCY_S * launched
        print(
            f"exposed wait per step: async {1e3 * a['exposed_wait_s'] / steady:.2f} ms, "
            f"blocking {1e3 * b['exposed_wait_s'] / steady:.2f} ms (injected {2e3 * LATENCY_S:.0f} ms)"
        )
