"""FSDP2 all-gathers FP8 weights (`fsdp_fp8_all_gather=True`) on real gloo ranks.

Each rank body trains the same model, from the same weights and per-rank data, twice: FSDP2 without the
option and FSDP2 with it. The two runs must be bitwise equal (losses, parameters, gradients, FP8 state)
because the cast is elementwise with the same scale, whether it runs before or after the gather. The
collective FSDP2 gathers with is wrapped to count the bytes, and the amax all-reduces are counted too.

The 2-rank scenarios share one set of ranks (`two_ranks`; those under FP8TRAIN_GEMM=scaled_mm another,
`two_ranks_scaled_mm`): each scenario starts from a fresh registry and builds its own model, so they are
independent, and a set of ranks starts once instead of once per test (a start costs seconds on a
loaded 2-core machine). A barrier after each scenario keeps the ranks in step should one fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fp8train
from helpers import digest, fp8_state
from multirank import CollectiveCounter, run_ranks, run_scenarios_together, scenario_outcome

RECIPE = fp8train.DelayedScaling(amax_history_len=4)


def _fully_shard():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _model(option: bool, width: int = 32, hidden: int = 24) -> torch.nn.Module:
    """Dim-0 sizes 24, 48, 32, 21: uneven over 3 ranks (32, 21), over 2 (21)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        fp8train.Linear(width, hidden, fsdp_fp8_all_gather=option),
        torch.nn.GELU(),
        fp8train.LayerNormMLP(hidden, 48, fsdp_fp8_all_gather=option),
        fp8train.LayerNormLinear(hidden, width, fsdp_fp8_all_gather=option),
        torch.nn.Tanh(),
        fp8train.Linear(width, 21, bias=False, fsdp_fp8_all_gather=option),
    )


def _converted(option: bool) -> torch.nn.Module:
    """torch.nn.Linear and transformers' Conv1D (a transposed weight) converted by convert_to_fp8."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.GELU(), Conv1D(32, 48), torch.nn.Tanh(), torch.nn.Linear(32, 16)
    )
    return fp8train.convert_to_fp8(model, fsdp_fp8_all_gather=option)


def _shard(model: torch.nn.Module, mp_dtype=None, reshard: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fully_shard = _fully_shard()
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _data(rank: int, step: int, rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "params": [_full(p.detach()).float().clone() for p in model.parameters()],
        "grads": [_full(p.grad).clone() for p in model.parameters() if p.grad is not None],
        "fp8": fp8_state(model),
    }


def _train(
    rank, model, steps, *, start=0, opt=None, eval_every=0, enabled=True, accumulate=1, recompute=False,
    rows=8, fsdp_accumulation=False,
):  # fmt: skip
    """`fsdp_accumulation`: FSDP2's own way (no gradient sync, weights kept gathered between
    microbatches), without is_first_microbatch: later microbatches meet weights gathered in FP8 for an
    earlier region."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = {"loss": [], "state": [], "opt": opt}
    for step in range(start, start + steps):
        for micro in range(accumulate):
            x = _data(rank, step * accumulate + micro, rows)
            first = None if accumulate == 1 or fsdp_accumulation else micro == 0
            if fsdp_accumulation:
                model.set_requires_gradient_sync(micro == accumulate - 1)
                model.set_reshard_after_backward(micro == accumulate - 1)
            with fp8train.fp8_autocast(enabled=enabled, fp8_recipe=RECIPE):
                if recompute:
                    y = fp8train.checkpoint(model, x, use_reentrant=False)
                elif first is None:
                    y = model(x)
                else:
                    y = x
                    for layer in model:
                        fp8 = isinstance(layer, fp8train.FP8Module)
                        y = layer(y, is_first_microbatch=first) if fp8 else layer(y)
                loss = y.float().pow(2).mean()
            loss.backward()
            out["loss"].append(loss.detach().clone())
        out["state"].append(_snapshot(model))
        opt.step()
        opt.zero_grad()
        if eval_every and step % eval_every == 0:
            with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=RECIPE):  # FP8 eval: records nothing
                out["loss"].append(model(_data(rank, 99)).float().pow(2).mean())
            with torch.no_grad():  # outside a region: gathered in the parameter dtype
                out["loss"].append(model(_data(rank, 98)).float().pow(2).mean())
    fp8train.synchronize()
    return out


def _both(rank: int, world: int, mp_dtype=None, kwargs=None, build=_model, reshard=True) -> dict:
    """The same training without and with the option, the collectives counted over the steps."""
    result = {}
    for option in (False, True):
        counter = CollectiveCounter()
        try:
            trained = _train(rank, _shard(build(option), mp_dtype, reshard), 4, **(kwargs or {}))
        finally:
            counter.close()
        trained.pop("opt")
        result[option] = {"run": trained, "gathers": counter.gathers, "all_reduces": counter.all_reduces}
    return result


def _check_equal(results: list[dict]) -> None:
    for rank_result in results:
        off, on = rank_result[False]["run"], rank_result[True]["run"]
        assert digest(off["loss"]) == digest(on["loss"]), "losses differ with fsdp_fp8_all_gather"
        for step, (a, b) in enumerate(zip(off["state"], on["state"])):
            for key in ("params", "grads", "fp8"):
                assert digest(a[key]) == digest(b[key]), f"{key} differ at step {step}"
    assert len({digest(r[True]["run"]["state"][-1]["fp8"]) for r in results}) == 1, "ranks' scales differ"


def _check_bytes(results: list[dict], world: int, itemsize: int, limit: float) -> None:
    """Every gather in FP8 bytes; the weight-only unit (the last Linear) at 1 byte per element."""
    weight_only = -(-21 // world) * 32 * itemsize  # its padded shard, in the parameter dtype
    for r in results:
        on, off = r[True]["gathers"], r[False]["gathers"]
        assert len(on) == len(off) and all(dtype == torch.uint8 for _, dtype in on), on
        ratios = [b_on / b_off for (b_on, _), (b_off, _) in zip(on, off) if b_off == weight_only]
        assert len(ratios) == 2 * 4, "expected a forward gather and a backward re-gather per step"
        assert max(ratios) <= limit, ratios
        assert r[True]["all_reduces"] == r[False]["all_reduces"], "the option changed the collective count"


def _scenarios(rank: int, world: int, names: list[str], directory: str) -> dict:
    """Inside a rank: the named scenarios of SCENARIOS in turn (`run_scenarios_together`)."""
    return run_scenarios_together(SCENARIOS, rank, world, names, directory)


def _shared_ranks(tmp_path_factory, names: list[str], env: dict | None = None) -> list[dict]:
    """One set of 2 ranks running `names`; each test reads its own with scenario_outcome."""
    directory = str(tmp_path_factory.mktemp("fsdp-fp8"))
    return run_ranks(_scenarios, 2, names, directory, env=env, timeout_s=600, pg_timeout_s=60)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _shared_ranks(tmp_path_factory, [n for n in SCENARIOS if n not in SCALED_MM])


@pytest.fixture(scope="module")
def two_ranks_scaled_mm(tmp_path_factory) -> list[dict]:
    return _shared_ranks(tmp_path_factory, list(SCALED_MM), env={"FP8TRAIN_GEMM": "scaled_mm"})


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_all_gather_is_bitwise_equal_with_fewer_bytes_and_no_added_collective(
    world: int, request
) -> None:
    """Dim-0 sizes 21 and 32 do not divide by 3 (uneven shards, padded gathers)."""
    if world == 2:
        results = scenario_outcome(request.getfixturevalue("two_ranks"), "plain")
    else:
        results = run_ranks(_both, world, None)
    _check_equal(results)
    _check_bytes(results, world, itemsize=4, limit=0.30)


@pytest.mark.multirank
def test_one_rank_needs_no_reduction() -> None:
    """A single-rank run (a smoke test) holds the whole weight: no amax group is needed."""
    results = run_ranks(_both, 1, None)
    _check_equal(results)
    assert all(dtype == torch.uint8 for _, dtype in results[0][True]["gathers"])


@pytest.mark.multirank
def test_fp8_all_gather_with_bf16_mixed_precision(two_ranks) -> None:
    results = scenario_outcome(two_ranks, "bf16")
    _check_equal(results)
    _check_bytes(results, 2, itemsize=2, limit=0.55)


PATTERNS = {
    "eval-between-steps": {"eval_every": 1},  # gathers switch FP8 -> FP8 without grad -> param dtype -> FP8
    "fp8-disabled": {"enabled": False},
    "grad-accumulation": {"accumulate": 2},
    "fsdp-accumulation": {"accumulate": 3, "fsdp_accumulation": True},
    "recompute": {"recompute": True},
}


@pytest.mark.multirank
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_fp8_all_gather_is_bitwise_equal_in_training_patterns(pattern: str, two_ranks) -> None:
    scenario = PATTERNS[pattern]
    results = scenario_outcome(two_ranks, pattern)
    _check_equal(results)
    uint8 = [dtype == torch.uint8 for _, dtype in results[0][True]["gathers"]]
    if scenario.get("enabled") is False:
        assert not any(uint8), "gathered in FP8 outside FP8 regions"
    elif "eval_every" in scenario:
        assert any(uint8) and not all(uint8), "evaluation outside the region must gather the parameter dtype"
    elif scenario.get("fsdp_accumulation"):
        # Later microbatches meet weights gathered in FP8 for an earlier region: re-gathered in the
        # parameter dtype (never used with the earlier region's scale).
        assert uint8[0] and not all(uint8)
    else:
        assert all(uint8)


def _resume(rank: int, world: int, path: str, load_option: bool) -> dict:
    """4 steps without a break against 2 steps, a distributed checkpoint saved with the option on, a
    fresh model (option `load_option`) loaded from it, 2 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    whole = _train(rank, _shard(_model(load_option)), 4)
    first = _shard(_model(True))
    before = _train(rank, first, 2)
    model_sd, opt_sd = get_state_dict(first, before["opt"])
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    second = _shard(_model(load_option))
    opt = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    model_sd, opt_sd = get_state_dict(second, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(second, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = _train(rank, second, 2, start=2, opt=opt)
    return {
        "whole": whole["loss"] + [s["fp8"] for s in whole["state"]] + [whole["state"][-1]["params"]],
        "resumed": before["loss"] + after["loss"] + [s["fp8"] for s in before["state"] + after["state"]]
        + [after["state"][-1]["params"]],
    }  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("load_into", ["into-fp8-gather", "into-plain"])
def test_distributed_checkpoint_resume_with_fp8_all_gather(load_into: str, two_ranks) -> None:
    """A checkpoint saved with the option loads with or without it: the saved weights are plain."""
    results = scenario_outcome(two_ranks, f"resume-{load_into}")
    for r in results:
        assert digest(r["resumed"]) == digest(r["whole"]), "resuming changed the training"


@pytest.mark.multirank
def test_converted_model_gathers_fp8_including_transposed_conv1d(two_ranks) -> None:
    results = scenario_outcome(two_ranks, "converted")
    _check_equal(results)
    assert all(dtype == torch.uint8 for _, dtype in results[0][True]["gathers"])


def test_option_without_fsdp_changes_nothing() -> None:
    """Unsharded, a wrapped weight is the weight: same training, same state_dict, same Parameters."""
    runs = {}
    for option in (False, True):
        model = _model(option)
        params = list(model.parameters())
        runs[option] = _train(0, model, 3, eval_every=1)
        runs[option]["sd"] = model.state_dict()
        assert all(a is b for a, b in zip(params, model.parameters()))
    assert digest(runs[False]["loss"]) == digest(runs[True]["loss"])
    params = {option: [s["params"] for s in run["state"]] for option, run in runs.items()}
    assert digest(params[False]) == digest(params[True])
    assert all(type(v) in (torch.Tensor, bytes) for v in runs[True]["sd"].values())
    assert digest(runs[False]["sd"]) == digest(runs[True]["sd"])


def _misuses(rank: int, world: int) -> list[str]:
    model = _shard(_model(True))
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        loss = model(_data(rank, 0)).pow(2).mean()
    del loss  # a skipped step (a non-finite loss, say): its graph is gone, no backward is owed
    with fp8train.fp8_autocast(fp8_recipe=RECIPE):
        owed = model(_data(rank, 1)).pow(2).mean()
    messages = []
    try:  # the backward of that forward is owed: its re-gather needs the weight's FP8 values
        with torch.no_grad(), fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(_data(rank, 2))
    except RuntimeError as error:
        messages.append(str(error))
    owed.backward()
    model = _shard(_model(True))  # a fresh one: FSDP2 does not recover from an error in its hooks
    model[0].register_forward_pre_hook(lambda module, args: module.weight.sum())  # gathered: refused
    try:
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(_data(rank, 3))
    except RuntimeError as error:
        messages.append(str(error))
    return messages


@pytest.mark.multirank
def test_misuses_of_fp8_gathered_weights_are_refused_on_every_rank(two_ranks) -> None:
    for messages in scenario_outcome(two_ranks, "misuses"):
        assert len(messages) == 2, messages
        assert "before the backward of its previous training forward" in messages[0]
        assert "holds gathered in FP8 (fsdp_fp8_all_gather): only its FP8 module can use it" in messages[1]


@pytest.mark.multirank
def test_fp8_all_gather_without_reshard_after_forward(two_ranks) -> None:
    """Weights stay gathered from forward to backward: no re-gather, the forward's FP8 values serve."""
    results = scenario_outcome(two_ranks, "no-reshard")
    _check_equal(results)
    gathers = results[0][True]["gathers"]
    assert len(gathers) == 4 * 4 and all(dtype == torch.uint8 for _, dtype in gathers)


def _model16(option: bool) -> torch.nn.Module:
    """Every GEMM dimension a multiple of 16 (torch._scaled_mm takes it); 48 rows shard unevenly on 3
    ranks... and 32 over 2: dim 0 sizes 48, 64, 32, 16."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        fp8train.Linear(32, 48, fsdp_fp8_all_gather=option),
        fp8train.LayerNormMLP(48, 64, fsdp_fp8_all_gather=option),
        fp8train.LayerNormLinear(48, 32, fsdp_fp8_all_gather=option),
        fp8train.Linear(32, 16, fsdp_fp8_all_gather=option),
    )


@pytest.mark.multirank
def test_real_fp8_operands_alias_the_gather_buffer_and_stay_bitwise_equal(two_ranks_scaled_mm) -> None:
    """FP8TRAIN_GEMM=scaled_mm: the forward saves FSDP2's gathered FP8 buffer itself for backward,
    which the backward re-gather must refill with the same values."""
    results = scenario_outcome(two_ranks_scaled_mm, "real-fp8-operands")
    _check_equal(results)


def _out_of_order(rank: int, world: int, pattern: str) -> str:
    model = _shard(_model16(True))
    x = _data(rank, 0, 16)
    try:
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            first = model(x).sum()
            if pattern == "eval-in-region":
                with torch.no_grad():
                    model(x)
            else:
                second = model(x).sum()
        if pattern == "two-in-region":
            first.backward()
            first = second  # still owed
        with fp8train.fp8_autocast(fp8_recipe=RECIPE):
            model(x)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("pattern", ["eval-in-region", "two-in-region"])
def test_owed_backward_is_tracked_per_forward(pattern: str, two_ranks_scaled_mm) -> None:
    """Another gather in the same region, or the backward of another forward, does not settle the
    debt of a forward whose backward has not run."""
    for message in scenario_outcome(two_ranks_scaled_mm, f"owed-{pattern}"):
        assert "before the backward of its previous training forward" in message, message


def _unreduced(rank: int, world: int, which: str) -> str:
    model = _shard(_model(True))
    recipe = fp8train.DelayedScaling(amax_history_len=4, reduce_amax=which != "no-reduction")
    group = None
    if which == "own-group":  # every rank creates both groups (a collective), each uses its own
        groups = [dist.new_group([0]), dist.new_group([1])]
        group = groups[rank]
        dist.barrier()  # rank 0 hosts the store: both groups are connected before either rank goes on
    try:
        with fp8train.fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            model(_data(rank, 0))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("which", ["no-reduction", "own-group"])
def test_amax_group_must_contain_the_sharding_group(which: str, two_ranks) -> None:
    """Else each rank would cast its shard with its own scale: refused on every rank."""
    for message in scenario_outcome(two_ranks, f"unreduced-{which}"):
        assert "the amax group reduces over" in message, message


def _microbatches_in_flight(rank: int, world: int, option: bool) -> dict:
    """A pipeline schedule's order (GPipe: every microbatch's forward, then the backwards): two
    forwards in two FP8 regions before the first backward."""
    model = _shard(_model(option))
    try:
        outs = []
        for micro in range(2):
            with fp8train.fp8_autocast(fp8_recipe=RECIPE):
                outs.append(model(_data(rank, micro)).float().pow(2).mean())
        sum(outs).backward()
        fp8train.synchronize()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.multirank
def test_fp8_all_gather_refuses_several_microbatches_in_flight_with_the_reason(two_ranks) -> None:
    """The backward re-gather must reproduce the FP8 weight its forward used; a later microbatch's
    forward (another region: other scales) would replace it. Refused on every rank, naming the fix;
    the same schedule without the option trains."""
    refused = scenario_outcome(two_ranks, "microbatches-fp8-gather")
    for r in refused:
        assert (
            r["error"] is not None and "several" in r["error"] and "microbatches in flight" in r["error"]
        ), r
        assert "without it" in r["error"]  # the fix: build the module without fsdp_fp8_all_gather
    assert all(r["error"] is None for r in scenario_outcome(two_ranks, "microbatches-plain"))


def _pattern(kwargs: dict):
    return lambda rank, world, _: _both(rank, world, None, kwargs)


# The 2-rank scenarios, by name: rank body(rank, world, a folder of its own). Those in SCALED_MM run on
# ranks with FP8TRAIN_GEMM=scaled_mm (read when the ranks start), the rest on ranks without it.
SCENARIOS = {
    "plain": lambda rank, world, _: _both(rank, world, None),
    "bf16": lambda rank, world, _: _both(rank, world, torch.bfloat16),
    **{name: _pattern(kwargs) for name, kwargs in PATTERNS.items()},
    "resume-into-fp8-gather": lambda rank, world, path: _resume(rank, world, path, True),
    "resume-into-plain": lambda rank, world, path: _resume(rank, world, path, False),
    "converted": lambda rank, world, _: _both(rank, world, None, None, _converted),
    "misuses": lambda rank, world, _: _misuses(rank, world),
    "no-reshard": lambda rank, world, _: _both(rank, world, None, None, _model, False),
    "unreduced-no-reduction": lambda rank, world, _: _unreduced(rank, world, "no-reduction"),
    "unreduced-own-group": lambda rank, world, _: _unreduced(rank, world, "own-group"),
    "microbatches-fp8-gather": lambda rank, world, _: _microbatches_in_flight(rank, world, True),
    "microbatches-plain": lambda rank, world, _: _microbatches_in_flight(rank, world, False),
    "real-fp8-operands": lambda rank, world, _: _both(
        rank, world, None, {"rows": 16, "eval_every": 1}, _model16
    ),
    "owed-eval-in-region": lambda rank, world, _: _out_of_order(rank, world, "eval-in-region"),
    "owed-two-in-region": lambda rank, world, _: _out_of_order(rank, world, "two-in-region"),
}
SCALED_MM = ("real-fp8-operands", "owed-eval-in-region", "owed-two-in-region")
