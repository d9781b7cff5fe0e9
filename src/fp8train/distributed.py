"""Bringing every rank of an amax group to one FP8 state.

DDP broadcasts parameters and buffers from rank 0 when it wraps a model, but FP8 state (amax
histories, scales) is module extra state, which it does not touch. After a checkpoint was loaded on
some ranks only, the ranks hold different FP8 state; the reduction header then fails its state check
on every rank (`StateMismatchError`). `broadcast_fp8_state` is the fix it names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .modules.base import FP8Module

__all__ = ["broadcast_fp8_state"]


def _agree_on_failure(error: str, group) -> str:
    """Every rank of `group` learns whether any rank failed (one all-reduce), so all raise together."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    failed = torch.tensor([float(bool(error))], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    return error or ("failed on another rank of the group (see its error)" if failed.item() else "")


def broadcast_fp8_state(model: torch.nn.Module, src: int = 0, group=None) -> None:
    """Give every rank of `group` the FP8 state of every FP8 module of `model` on rank `src`.

    Collective: every rank of `group` (default: the world) calls it with the same model structure;
    `src` is a global rank. Call it after loading a checkpoint on some ranks only, before the next FP8
    step. Reading and writing the state completes each module's in-flight reductions first. If the
    ranks' FP8 modules differ, or an amax reduction of the model has already failed on some rank,
    every rank raises.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]
    names = [name for name, _ in modules]
    directions = {
        id(meta.direction): meta.direction
        for _, m in modules
        for meta in m.fp8_meta.values()
        if meta.direction is not None
    }
    failures = [message for message in (d.failure_message() for d in directions.values()) if message]
    error = _agree_on_failure(failures[0] if failures else "", group)
    if error:
        raise RuntimeError(
            f"broadcast_fp8_state: an FP8 amax reduction of this model has already failed ({error}). A "
            "failed amax group cannot be resynchronised in this process: restart from the last "
            "checkpoint, and load it on every rank or call broadcast_fp8_state right after loading, "
            "before the first FP8 step"
        )
    payload = [(names, [m.get_extra_state() for _, m in modules]) if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    src_names, states = payload[0]
    error = ""
    if src_names != names:
        error = (
            f"rank {dist.get_rank()} has FP8 modules {names[:4]}... ({len(names)}) but rank {src} has "
            f"{src_names[:4]}... ({len(src_names)}); broadcast_fp8_state needs the same model on every rank"
        )
    else:
        try:
            for (_, module), state in zip(modules, states):
                module.set_extra_state(state)  # on src too: it also drops cached FP8 weights
        except ValueError as exc:
            error = f"rank {dist.get_rank()}: {exc}"
    error = _agree_on_failure(error, group)
    if error:
        raise ValueError(f"broadcast_fp8_state: {error}")
