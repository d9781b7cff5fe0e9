"""Bringing every rank of an amax group to one FP8 state.

DDP broadcasts parameters and buffers from rank 0 when it wraps a model, but FP8 state (amax
histories, scales) is module extra state, which it does not touch. After a checkpoint was loaded on
some ranks only, the ranks hold different scales; the reduction header then fails its state check
on every rank (`StateMismatchError`). `broadcast_fp8_state` is the fix it names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .modules.base import FP8Module

__all__ = ["broadcast_fp8_state"]


def broadcast_fp8_state(model: torch.nn.Module, src: int = 0, group=None) -> None:
    """Give every rank of `group` the FP8 state of every FP8 module of `model` on rank `src`.

    Collective: every rank of `group` (default: the world) calls it with the same model structure;
    `src` is a global rank. A rank whose FP8 modules differ from `src`'s makes every rank raise a
    ValueError. Call it after loading a checkpoint on some ranks only, before the next FP8 region.
    Reading and writing the state completes each module's in-flight reductions first, so none of
    them can land on top of the broadcast state.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]
    names = [name for name, _ in modules]
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
                module.set_extra_state(state)
        except ValueError as exc:
            error = f"rank {dist.get_rank()}: {exc}"
    # every rank learns whether any rank failed, so that all of them raise together
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    failed = torch.tensor([float(bool(error))], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error or failed.item():
        raise ValueError(error or "broadcast_fp8_state failed on another rank of the group (see its error)")
