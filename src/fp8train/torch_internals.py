"""Every use of torch's private API and of DDP/FSDP2 internals, in one place (docs/design.md, section 12).

Each function says what fp8train needs it for and what it relies on. All of them were checked on
torch 2.13.0 (the tested version) and on the lowest supported torch (pyproject.toml; docs/design.md
says how). When a torch upgrade breaks fp8train, this is the file to read first.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = [
    "graph_task_id",
    "in_backward",
    "at_end_of_backward",
    "register_ordered_effects",
    "scaled_mm",
    "has_scaled_mm",
    "unsafe_view",
    "tree_leaves",
    "tree_map_only",
    "inside_reentrant_checkpoint",
    "ddp_join_that_does_not_throw",
    "fsdp_param_of_caller",
    "pipeline_group_of_caller",
    "in_pipeline_shape_inference",
    "ddp_ignore",
]


# ---- autograd engine -------------------------------------------------------------------------------
def graph_task_id() -> int:
    """The running backward pass (autograd graph task), -1 outside one (`torch._C`).

    Names a backward pass: its amaxes are launched when it ends, and amaxes a pass left behind when
    it raised are told apart from the next pass's."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether a backward pass is running: there, a forward call is an activation recomputation."""
    return graph_task_id() != -1


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (the engine's `queue_callback`): the one point
    every rank reaches after every collective DDP or FSDP2 issued during the pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_ordered_effects(ops: Iterable) -> bool:
    """Mark custom ops as ordered side effects (`torch._higher_order_ops.effects`), so compiled graphs
    neither drop nor reorder the protocol's ops. False where torch has no such registry."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    for op in ops:
        _register_effectful_op(op, _EffectType.ORDERED)
    return True


# ---- ops --------------------------------------------------------------------------------------------
@functools.cache
def has_scaled_mm(device_type: str) -> bool:
    """Whether `torch._scaled_mm` runs on this device type: CUDA had it from torch 2.1; the CPU
    kernel came later (absent in 2.7), so a 16x16 product is tried once on the CPU."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device_type != "cpu":
        return True
    try:
        one = torch.ones((), dtype=torch.float32)
        a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """The hardware FP8 GEMM (`torch._scaled_mm`, cuBLASLt): a row-major, b column-major."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def unsafe_view(tensor: torch.Tensor, shape) -> torch.Tensor:
    """A reshape whose result autograd does not treat as a view (`aten._unsafe_view`): what an FP8 GEMM
    returns, so that in-place ops on it (torch.relu_, a TP all-reduce) work as on torch.nn.Linear's."""
    return torch.ops.aten._unsafe_view(tensor, shape)


def tree_leaves(tree) -> list:
    """Tensors nested in a __torch_dispatch__ call's arguments (`torch.utils._pytree`)."""
    return torch.utils._pytree.tree_leaves(tree)


def tree_map_only(cls: type, fn: Callable, tree):
    return torch.utils._pytree.tree_map_only(cls, fn, tree)


# ---- call stacks: whose code is calling ------------------------------------------------------------------
def _caller_frames(skip: int):
    frame = sys._getframe(skip + 1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def inside_reentrant_checkpoint() -> bool:
    """Whether torch.utils.checkpoint(use_reentrant=True) is running a forward below us (its forward is
    `CheckpointFunction.forward`, found on the call stack): it runs without grad and cannot be matched
    to its recomputation, so it is refused in FP8 training regions."""
    code = torch.utils.checkpoint.CheckpointFunction.forward.__code__
    return any(frame.f_code is code for frame in _caller_frames(1))


def ddp_join_that_does_not_throw() -> bool:
    """Whether a DistributedDataParallel forward below us runs inside `join()` without
    `throw_on_early_termination` (DDP's private `_join_config`, torch >= 2.0): a rank that ran out of
    data would shadow DDP's collectives but not the amax all-reduce."""
    ddp_forward = torch.nn.parallel.DistributedDataParallel.forward.__code__
    for frame in _caller_frames(1):
        if frame.f_code is ddp_forward:
            config = getattr(frame.f_locals.get("self"), "_join_config", None)
            return config is not None and config.enable and not config.throw_on_early_termination
    return False


def pipeline_group_of_caller() -> Optional[Any]:
    """The process group of the `torch.distributed.pipelining` stage whose forward is running below us
    (a `_PipelineStageBase` found on the call stack: its `group`, None for the world), or False when
    no stage is running. Lets a module check, alone, that its amax group stays inside its stage."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return False
    for frame in _caller_frames(1):
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _PipelineStageBase):
            return candidate.group
    return False


_PIPELINE_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


def in_pipeline_shape_inference() -> bool:
    """Whether a `torch.distributed.pipelining` stage is running its one-time metadata (shape)
    inference below us: a forward on uninitialised tensors (torch.empty) of the right shapes, with
    grad enabled. FP8 regions entered there must neither cast nor record (the garbage would poison the
    amax histories for a whole history window). Checked only once pipelining has been imported."""
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    return any(frame.f_code.co_name in _PIPELINE_INFERENCE for frame in _caller_frames(1))


def fsdp_param_of_caller() -> Any:
    """The FSDP2 `FSDPParam` that called an extension point of a parameter's tensor (torch >= 2.6).

    FP8 all-gathers change the dtype and size of the gather buffers FSDP2 caches per parameter
    (`FSDPParam.all_gather_outputs`) and of the buffer it frees at reshard
    (`FSDPParam._unsharded_inner_tensors`): fsdp.py resets and sets them on the object found here."""
    for frame in _caller_frames(1):
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "FSDPParam" and hasattr(candidate, "all_gather_outputs"):
            return candidate
    raise RuntimeError(
        "fsdp_fp8_all_gather: FSDP2's extension points were called from outside an FSDPParam; this torch "
        f"({torch.__version__}) changed FSDP2's internals. Build the modules without fsdp_fp8_all_gather"
    )


def reset_fsdp_gather_buffers(fsdp_param: Optional[Any] = None) -> None:
    """Make FSDP2 allocate new all-gather buffers for the calling parameter (a precision change)."""
    (fsdp_param or fsdp_param_of_caller()).all_gather_outputs = []


def set_fsdp_unsharded_buffer(data: torch.Tensor) -> None:
    """Tell FSDP2 which buffer to free when the calling parameter is resharded."""
    fsdp_param_of_caller()._unsharded_inner_tensors = [data]


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """Make DistributedDataParallel(module) leave these parameters alone (neither broadcast at
    construction nor reduced): DDP's private `_set_params_and_buffers_to_ignore_for_model`, torch >=
    1.8. Stored FP8 weights need it: gloo cannot broadcast FP8 dtypes."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, sorted(ignored)
    )
