"""Expert parallelism: the experts of a mixture-of-experts layer split over the ranks of an
expert-parallel (EP) group, tokens sent to their experts' ranks and back by all-to-all
(docs/design.md, section 9.2, "Expert parallelism"; the guide's "Mixture of experts").

E experts over the W ranks of `ep_group`: rank r holds experts r*E/W .. (r+1)*E/W - 1 (its local
experts, in order). `dispatch` sorts this rank's (token, slot) rows by expert, exchanges the row
counts (one small all-to-all: W x (E/W) counts, plus each rank's verdicts: amax group, expert ids),
then sends the rows (one all-to-all with the exchanged split sizes); the received rows are
regrouped by local expert (source ranks in order within each), ready for
`GroupedLinear(inp, m_splits)`. `combine` undoes it:
the reverse regrouping, the reverse all-to-all, the original row order. Both are differentiable: the
backward of an all-to-all is the all-to-all with the split sizes swapped.

The amax group of the experts' roles. The experts on the ranks of `ep_group` are *different*
experts: MAX-reducing their amaxes together would give each expert another expert's scale. Their
group is the data-parallel replicas of the same experts (with every rank expert-parallel and no
replica: the rank alone, or `reduce_amax=False`). `ExpertParallel(amax_group=...)` runs the experts
in a region of that group (nested in the caller's region, same recipe); a group holding other ranks
of `ep_group` is refused at construction, and at run time (the enclosing region's group when no
amax_group is given) before any token moves: each rank's verdict travels in the count exchange, so
every rank of `ep_group` raises alike (no rank is left waiting in an all-to-all), and the experts'
modules are marked so that `amax.membership.check_amax_group` refuses them in such a group anywhere.

FP8 dispatch (`fp8_dispatch=True`, inside an enabled FP8 region): the rows travel as E4M3 with one
E8M0 (power-of-two) scale per 128 values of a row (`comm.wire.encode`), 1 + 1/128 bytes a value
against bf16's 2 (0.504x for hidden sizes that are multiples of 128, the scales included); decoded
exactly (FP8 value times a power of two, exact in float32 and bf16) into the tokens' dtype. The
gradient travels back in the tokens' dtype (straight through the rounding, as every FP8 cast of the
library). Why 1x128 chunks and power-of-two scales, not one float scale per row: the scale travels
in the row's own bytes (one message, no second collective), an outlier spoils 128 values instead of
a row, decoding is a shift (exact), and under Float8BlockScaling (power-of-two scales, 1x128 input
tiles along the features, E4M3) the expert GEMM's forward input is the FP8 value it would have cast
from the original rows: the decoded tile re-casts to itself (DeepSeek-V3 quantizes the activations
before its dispatch to 1x128-tile FP8 for that reason: its up-projection's FP8 forward takes them as
they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .amax import membership
from .autocast import fp8_autocast
from .comm import wire
from .modules import FP8Module
from .runtime import current_settings

__all__ = ["ExpertParallel", "Dispatched", "dispatch", "combine", "mark_experts"]

DISPATCH_CHUNK = 128  # values per E8M0 scale of an FP8-dispatched row


def mark_experts(experts: torch.nn.Module, ep_group) -> None:
    """Mark every FP8 module in `experts` as holding this rank's share of experts split over
    `ep_group`: when they first train, the amax protocol's group check (`check_amax_group`) refuses
    an amax group holding other ranks of ep_group, wherever they are called."""
    for m in experts.modules():
        if isinstance(m, FP8Module):
            m.expert_parallel_group = ep_group


def _region_error(ep_group, amax_group) -> Optional[str]:
    """The error of the region the experts are about to run in (delayed scaling that records and
    reduces across ranks in a group holding other ep_group ranks), or None. `amax_group` None: the
    caller's region's group."""
    settings = current_settings()
    if settings is None or not settings.active or not settings.quantization.reduces_amax:
        return None
    group = settings.group if amax_group is None else amax_group
    return membership.expert_group_error("ExpertParallel", group, ep_group, settings.recipe)


# ---- the collectives ------------------------------------------------------------------------------------


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group) -> None:
    """`dist.all_to_all_single`, looked up per call (a byte counter may wrap it); 1-byte floats
    travel as raw bytes (gloo moves no float8 dtype)."""
    wire_out, wire_in = out, inp
    if inp.dtype.itemsize == 1 and inp.is_floating_point():
        wire_out, wire_in = out.view(torch.uint8), inp.view(torch.uint8)
    dist.all_to_all_single(wire_out, wire_in, out_splits, in_splits, group=group)


def _exchange(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    _all_to_all(out, x.contiguous(), recv_rows, send_rows, group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by `send_rows`, received by `recv_rows`; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group):
        ctx.splits, ctx.group = (send_rows, recv_rows), group
        return _exchange(x, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.splits
        return _exchange(grad, recv_rows, send_rows, ctx.group), None, None, None


class _FP8AllToAll(torch.autograd.Function):
    """`_AllToAll` with the rows as E4M3 and their E8M0 chunk scales on the wire (wire.encode), decoded
    exactly into x's dtype; the gradient travels back in x's dtype, straight through the rounding."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group, chunk):
        ctx.splits, ctx.group = (send_rows, recv_rows), group
        n = x.shape[1]
        encoded = wire.encode(x.reshape(len(x), n), chunk, "e4m3")
        received = _exchange(encoded, send_rows, recv_rows, group)
        return wire.decode(received, n, chunk, "e4m3").to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.splits
        return _exchange(grad, recv_rows, send_rows, ctx.group), None, None, None, None


# ---- dispatch and combine -------------------------------------------------------------------------------


@dataclass
class Dispatched:
    """What `combine` needs to bring the experts' rows back (from `dispatch`)."""

    group: object
    order: torch.Tensor  # sent row i is this rank's flat (token, slot) row order[i]
    regroup: torch.Tensor  # local row j is received row regroup[j]
    send_rows: list[int]  # rows sent to each rank of the group
    recv_rows: list[int]  # rows received from each rank
    m_splits: list[int]  # rows of each local expert (the local rows' groups, in order)
    recv_counts: list[list[int]]  # recv_counts[s][j]: rows from rank s for local expert j
    slots_shape: tuple  # expert_ids' shape: combine's output is (*slots_shape, features)


def dispatch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    group=None,
    fp8: bool = False,
    chunk: int = DISPATCH_CHUNK,
    _error: Optional[str] = None,
) -> tuple[torch.Tensor, list[int], Dispatched]:
    """Send each (token, slot) row to the rank of its expert. Collective over `group` (the EP group;
    None: the world); every rank calls it, with its own tokens.

    Args:
        tokens: (T, hidden) this rank's tokens.
        expert_ids: (T,) or (T, k) int: the expert of each token (of each of its k slots), in
            [0, num_experts); expert e lives on rank e // (num_experts / W).
        num_experts: E, a multiple of the group's size W.
        group: the expert-parallel process group.
        fp8: send the rows as E4M3 with one E8M0 scale per `chunk` values (decoded exactly).
        chunk: values per scale of an FP8 row (default 128).

    Returns:
        (local rows, m_splits, handle): the rows of this rank's E/W experts, grouped by local expert
        (source ranks in order, each source's rows in (token, slot) order), the row count of each
        local expert (GroupedLinear's m_splits), and the handle for `combine`.

    Raises:
        ValueError: bad sizes (before any collective), or, on every rank of the group after the
            count exchange, expert ids out of range on some rank or an amax group that holds other
            ranks of the group (ExpertParallel's check)."""
    group = dist.group.WORLD if group is None else group
    world = dist.get_world_size(group)
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
        raise ValueError(
            f"expert parallelism: num_experts={num_experts!r} must be a positive multiple of the ep_group's "
            f"{world} ranks (each rank holds num_experts / {world} experts)"
        )
    if tokens.dim() != 2 or expert_ids.dtype.is_floating_point or expert_ids.shape[:1] != tokens.shape[:1]:
        raise ValueError(
            "expert parallelism: tokens must be (T, hidden) and expert_ids (T,) or (T, k) integers; got "
            f"tokens {tuple(tokens.shape)} and expert_ids {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    local = num_experts // world
    flat = expert_ids.reshape(-1).long()
    slots = flat.numel() // max(tokens.shape[0], 1)
    with torch.no_grad():
        # the ranks' verdicts travel with the counts, so that every rank raises alike (none is left
        # waiting in the rows' all-to-all): 1, this rank's experts would run in a bad amax group;
        # 2, its expert ids are out of range (counted clamped, then refused)
        out_of_range = ((flat < 0) | (flat >= num_experts)).any()
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts).view(world, local)
        flag = (out_of_range.long() * _BAD_IDS + int(_error is not None) * _BAD_GROUP).expand(world, 1)
        sent = torch.cat([per_expert, flag], 1)
        got = torch.empty_like(sent)
        _all_to_all(got, sent, None, None, group)
        counts = torch.cat([got.reshape(-1), per_expert.sum(1)]).tolist()  # the one host read
    table = [counts[s * (local + 1) : (s + 1) * (local + 1)] for s in range(world)]
    send_rows = counts[world * (local + 1) :]
    _raise_flagged([row[local] for row in table], _error, num_experts, group)
    recv_counts = [row[:local] for row in table]
    recv_rows = [sum(row) for row in recv_counts]
    rows = tokens[order // slots] if slots else tokens[:0]
    exchanged = (
        _FP8AllToAll.apply(rows, send_rows, recv_rows, group, chunk)
        if fp8
        else _AllToAll.apply(rows, send_rows, recv_rows, group)
    )
    regroup = _regroup_index(recv_counts, world, local).to(tokens.device)
    m_splits = [sum(recv_counts[s][j] for s in range(world)) for j in range(local)]
    handle = Dispatched(group, order, regroup, send_rows, recv_rows, m_splits, recv_counts,
                        tuple(expert_ids.shape))  # fmt: skip
    return exchanged[regroup], m_splits, handle


_BAD_GROUP, _BAD_IDS = 1, 2


def _raise_flagged(flags: list[int], error: Optional[str], num_experts: int, group) -> None:
    """Raise on every rank of the group when any rank flagged a verdict (`dispatch`)."""
    if not any(flags):
        return
    if error is not None:
        raise ValueError(error)
    bad_ids = [dist.get_global_rank(group, s) for s, f in enumerate(flags) if f & _BAD_IDS]
    if bad_ids:
        raise ValueError(
            f"expert parallelism: expert ids must lie in [0, {num_experts}); ranks {bad_ids} gave others;"
            " every rank of the group stops here, before the rows move"
        )
    flagged = [dist.get_global_rank(group, s) for s, f in enumerate(flags) if f & _BAD_GROUP]
    raise ValueError(
        f"ExpertParallel: ep_group ranks {flagged} run their experts in an amax group that "
        "holds other ranks of their ep_group (their error says which); this rank stops with them. Give the "
        "experts the amax group of the data-parallel replicas of each rank's experts"
    )


def _regroup_index(recv_counts: list[list[int]], world: int, local: int) -> torch.Tensor:
    """Received rows come (source rank, local expert); the experts take them (local expert, source)."""
    starts, at = {}, 0
    for s in range(world):
        for j in range(local):
            starts[s, j] = at
            at += recv_counts[s][j]
    pieces = [
        torch.arange(starts[s, j], starts[s, j] + recv_counts[s][j])
        for j in range(local)
        for s in range(world)
        if recv_counts[s][j]
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def combine(local_out: torch.Tensor, handle: Dispatched) -> torch.Tensor:
    """The experts' output rows (in `dispatch`'s local order) back to the ranks and rows they came
    from: (*expert_ids.shape, features), row (t, slot) the output of token t's slot-th expert.
    Collective over the group of `dispatch`; differentiable."""
    if local_out.dim() != 2 or local_out.shape[0] != len(handle.regroup):
        raise ValueError(
            "expert parallelism: combine takes the experts' (rows, features) output of the "
            f"{len(handle.regroup)} dispatched rows, got {tuple(local_out.shape)}"
        )
    received_order = torch.empty_like(handle.regroup)
    received_order[handle.regroup] = torch.arange(len(handle.regroup), device=handle.regroup.device)
    back = _AllToAll.apply(local_out[received_order], handle.recv_rows, handle.send_rows, handle.group)
    unsort = torch.empty_like(handle.order)
    unsort[handle.order] = torch.arange(len(handle.order), device=handle.order.device)
    return back[unsort].view(*handle.slots_shape, local_out.shape[1])


# ---- the module -----------------------------------------------------------------------------------------


class ExpertParallel(torch.nn.Module):
    """This rank's experts of a mixture-of-experts layer whose experts are split over `ep_group`:
    `forward(tokens, expert_ids)` dispatches every (token, slot) row to its expert's rank, runs
    `experts(local_rows, m_splits)` there and brings the outputs back.

    Args:
        experts: this rank's num_experts / W experts as a module called `experts(x, m_splits)`, e.g.
            a `GroupedLinear`, or a module of GroupedLinears and an activation; local expert j is
            global expert rank * num_experts / W + j.
        num_experts: E, all experts of the layer over the group (a multiple of its size).
        ep_group: the expert-parallel process group (None: the world).
        amax_group: the amax group of the experts' delayed-scaling roles: the data-parallel replicas
            of this rank's experts (a single-rank group when there is none). The experts run in a
            region of this group nested in the caller's (same recipe). None: they run in the
            caller's region and its group, checked the same way.
        fp8_dispatch: inside an FP8 region (enabled), send the dispatched rows as E4M3 with E8M0
            scales per 128 values; outside one they travel in the tokens' dtype.

    Raises:
        ValueError (every rank): `amax_group` holds other ranks of `ep_group`; at run time, the same
            for the caller's group when `amax_group` is None and delayed scaling reduces."""

    def __init__(
        self,
        experts: torch.nn.Module,
        num_experts: int,
        ep_group=None,
        amax_group=None,
        fp8_dispatch: bool = False,
    ) -> None:
        super().__init__()
        self.experts = experts
        self.num_experts = num_experts
        self.ep_group = dist.group.WORLD if ep_group is None else ep_group
        self.amax_group = amax_group
        self.fp8_dispatch = bool(fp8_dispatch)
        size = dist.get_world_size(self.ep_group)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % size:
            raise ValueError(
                f"ExpertParallel: num_experts={num_experts!r} must be a positive multiple of the ep_group's "
                f"{size} ranks"
            )
        self.local_experts = num_experts // size
        self.first_expert = dist.get_rank(self.ep_group) * self.local_experts
        named = amax_group is not None
        error = membership.expert_group_error("ExpertParallel", amax_group, self.ep_group) if named else None
        if error:
            raise ValueError(error)
        mark_experts(experts, self.ep_group)

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """(*expert_ids.shape, out_features): row (t, slot) is token t through its slot-th expert.

        Args:
            tokens: (T, hidden) this rank's tokens.
            expert_ids: (T,) or (T, k) the experts of each token (the router's top-k choice)."""
        error = _region_error(self.ep_group, self.amax_group)
        settings = current_settings()
        fp8 = self.fp8_dispatch and settings is not None and settings.enabled  # FP8 inside FP8 regions only
        local, m_splits, handle = dispatch(
            tokens, expert_ids, self.num_experts, self.ep_group, fp8, _error=error
        )
        if self.amax_group is None or settings is None:
            out = self.experts(local, m_splits)
        else:
            with fp8_autocast(settings.enabled, settings.calibrating, settings.recipe, self.amax_group):
                out = self.experts(local, m_splits)
        return combine(out.reshape(-1, out.shape[-1]), handle)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local experts {self.first_expert}.."
            f"{self.first_expert + self.local_experts - 1}, fp8_dispatch={self.fp8_dispatch}"
        )
