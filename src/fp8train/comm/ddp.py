"""FP8 gradient all-reduce as a DDP communication hook. docs/design.md, section 15; the guide's
"FP8 gradient communication".

Per bucket of n values on W ranks: the bucket is cut into W shards of S = ceil(n / W) values (zero
padded), shard r owned by rank r. Two collectives on the state's own process group:

1. all_to_all: every rank sends shard r, as FP8 with its chunk scales (wire.encode), to rank r;
2. rank r decodes the W contributions, sums them in float32 in rank order 0..W-1, divides by W, and
   all-gathers the mean shard as FP8 with its own chunk scales (or bf16: `return_format`).

Every rank decodes the same gathered bytes, so every rank holds the same values bit for bit; each
shard's sum is computed once, by its owner, in a fixed order, so it is also deterministic run to run.
The scales travel with the values: the receiver decodes each contribution with its sender's scale,
so no collective has to agree on scales first (section 15 says why that is the better design).

Asynchronous: the hook returns a future at once; the return trip starts from the first collective's
completion callback and the future completes when the gathered shard is decoded. Both collectives
of all buckets are issued in one order on every rank (`OrderedLauncher`), on a process group that
nothing else uses (DDP's own collectives could otherwise interleave differently per rank).
"""

# no `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with the objects dist.GradBucket and torch.futures.Future[torch.Tensor], not with strings
import datetime
import functools
import weakref
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..numerics.formats import Format
from . import wire
from .ordered import OrderedLauncher

__all__ = ["FP8CommState", "fp8_allreduce_hook", "fp8_encoding"]

RETURN_FORMATS = ("fp8", "bf16")
_FP8_DTYPES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_encoding(fp8_format: Union[Format, str, torch.dtype]) -> str:
    """ "e4m3" or "e5m2" from `fp8_format`: a `Format` (E4M3, E5M2), its name, or the torch FP8 dtype.

    Raises:
        ValueError: `Format.HYBRID` (two encodings) or anything else (the message names the choices).
    """
    if isinstance(fp8_format, Format):
        if fp8_format.fwd != fp8_format.bwd:
            raise ValueError(
                f"fp8_format={fp8_format} names two encodings (E4M3 forward, E5M2 backward); gradient "
                "communication uses one: pass Format.E4M3 or Format.E5M2"
            )
        return fp8_format.fwd
    if isinstance(fp8_format, torch.dtype) and fp8_format in _FP8_DTYPES:
        return _FP8_DTYPES[fp8_format]
    if isinstance(fp8_format, str) and fp8_format.lower() in wire.ENCODINGS:
        return fp8_format.lower()
    raise ValueError(
        f"fp8_format={fp8_format!r} is not an FP8 format; pass Format.E4M3 or Format.E5M2 (or 'e4m3', "
        "'e5m2', torch.float8_e4m3fn, torch.float8_e5m2). For bf16 communication use torch's "
        "bf16_compress_hook (torch.distributed.algorithms.ddp_comm_hooks.default_hooks)"
    )


class _Residuals:
    """Error feedback: per bucket, what rounding left out last time, and the layout it belongs to.
    DDP rebuilds its buckets once, after the first iteration; a residual whose bucket changed is
    dropped (that step's rounding error then goes uncorrected, as without error feedback)."""

    def __init__(self) -> None:
        self._by_key: dict[Any, tuple[tuple, torch.Tensor]] = {}

    def take(self, key: Any, layout: tuple, like: torch.Tensor) -> torch.Tensor:
        held = self._by_key.pop(key, None)
        if held is None or held[0] != layout:
            return torch.zeros_like(like)
        return held[1]

    def keep(self, key: Any, layout: tuple, residual: torch.Tensor) -> None:
        self._by_key[key] = (layout, residual)


class FP8CommState:
    """What `fp8_allreduce_hook` needs: the process group, the format and options, and the state that
    lives across steps (error feedback residuals, the rounding generator, the launch order).

    process_group: the ranks to reduce over (DDP's). None: a new group of all ranks, created here (so
      every rank must construct its state at the same point, torch's rule for new_group). A group
      passed in must be used by nothing else: the hook issues collectives from completion callbacks.
    fp8_format: Format.E4M3 (default: the smaller measured error, docs/benchmarks.md) or Format.E5M2.
    chunk_size: values per scale (one byte per chunk on the wire: 1/chunk_size more bytes).
    return_format: "fp8" (the mean shard in FP8 with its own chunk scales) or "bf16".
    stochastic_rounding: round both trips stochastically (unbiased), from a generator seeded with
      `seed` and the rank.
    error_feedback: add what rounding left out of this rank's contribution (and, on the owner, of its
      mean shard) to the next step's values of the same bucket.
    timeout: of the group created when process_group is None (None: torch's default for new groups,
      not the one init_process_group was given); with a group passed in, that group's own timeout
      holds and giving one here is refused. It bounds each of the hook's collectives: a peer that
      stalls past it (or stops) makes the step's backward raise on the others, naming the hook.
      DDP's own collectives (its bucket rebuild in the second iteration's forward, buffer
      broadcasts) run on DDP's process_group and fp8train's amax reductions on their amax group,
      each bounded by its own group's timeout (docs/guide.md, "FP8 gradient communication")."""

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        fp8_format: Union[Format, str, torch.dtype] = Format.E4M3,
        chunk_size: int = 128,
        return_format: str = "fp8",
        stochastic_rounding: bool = False,
        seed: int = 0,
        error_feedback: bool = False,
        timeout: Optional[datetime.timedelta] = None,
    ) -> None:
        self.encoding = fp8_encoding(fp8_format)
        self.chunk_size = wire.checked_chunk_size(chunk_size)
        if return_format not in RETURN_FORMATS:
            raise ValueError(f"return_format must be one of {RETURN_FORMATS}, got {return_format!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FP8CommState needs torch.distributed initialised (init_process_group) first")
        self.return_format = return_format
        self.rounding = wire.RoundingGenerators(stochastic_rounding, seed)
        self.error_feedback = bool(error_feedback)
        if process_group is not None and timeout is not None:
            raise ValueError(
                "FP8CommState: timeout is the timeout of the group created when process_group is None; "
                "a group passed in keeps its own (create it with dist.new_group(ranks, timeout=...))"
            )
        if process_group is None and dist.get_world_size() > 1:
            process_group = dist.new_group(timeout=timeout)  # a dedicated copy of the world group
        self.group = process_group
        self.timeout = timeout
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._launcher = OrderedLauncher()
        self._calls = 0
        self._sent = _Residuals()
        self._returned = _Residuals()

    def __repr__(self) -> str:
        return (
            f"FP8CommState(world_size={self.world_size}, encoding={self.encoding!r}, chunk_size="
            f"{self.chunk_size}, return_format={self.return_format!r}, stochastic_rounding="
            f"{self.rounding.enabled}, error_feedback={self.error_feedback})"
        )

    # ---- the reduction ------------------------------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, key: Any = None, layout: Sequence = ()
    ) -> torch.futures.Future[torch.Tensor]:
        """Start the mean of `tensor` over the group, FP8 on the wire; the future's value is `tensor`,
        overwritten with the mean (the same bits on every rank). Every rank must call it with tensors
        of the same size in the same order. `key` names the tensor across steps for error feedback
        (DDP's bucket index), `layout` what it holds (a residual is only reused for the same layout).
        One rank: `tensor` unchanged, no rounding (nothing to communicate)."""
        if not tensor.is_floating_point():
            raise TypeError(f"FP8 gradient communication reduces floating-point tensors, got {tensor.dtype}")
        result = torch.futures.Future(devices=[tensor.device] if tensor.device.type != "cpu" else None)
        if self.world_size == 1:
            result.set_result(tensor)
            return result
        if self.error_feedback and key is None:
            raise ValueError(
                "error_feedback needs a key that names the tensor across steps (DDP: the bucket)"
            )
        seq = 2 * self._calls
        self._calls += 1
        n, world = tensor.numel(), self.world_size
        shard = -(-n // world)
        layout = (n, tuple(layout))
        values = tensor.detach().reshape(-1).float()
        if self.error_feedback:
            values = values + self._sent.take(key, layout, values)
        rows = F.pad(values, (0, world * shard - n)).view(world, shard)
        sent = wire.encode(
            rows, self.chunk_size, self.encoding, self.rounding.get(tensor.device, self.rank, trip=0)
        )
        if self.error_feedback:
            decoded = wire.decode(sent, shard, self.chunk_size, self.encoding)
            self._sent.keep(key, layout, (rows - decoded).view(-1)[:n])
        _Reduction(self, seq, tensor, sent, key, layout, result).start()
        return result

    def _reduce_shard(
        self, received: torch.Tensor, shard: int, key: Any, layout: tuple, device: torch.device
    ) -> torch.Tensor:
        """This rank's shard: the W contributions summed in float32 in rank order, over W, encoded for
        the return trip (bytes)."""
        contributions = wire.decode(received, shard, self.chunk_size, self.encoding)
        total = contributions[0].clone()
        for r in range(1, self.world_size):
            total += contributions[r]
        mean = total.div_(self.world_size).unsqueeze(0)
        if self.error_feedback:
            mean += self._returned.take(key, layout, mean)
        if self.return_format == "bf16":
            data = mean.to(torch.bfloat16)
            if self.error_feedback:
                self._returned.keep(key, layout, mean - data.float())
            return data.view(torch.uint8).reshape(-1)
        # the return trip's own generator: its draws run on the callback thread, in bucket order
        data = wire.encode(mean, self.chunk_size, self.encoding, self.rounding.get(device, self.rank, trip=1))
        if self.error_feedback:
            self._returned.keep(key, layout, mean - wire.decode(data, shard, self.chunk_size, self.encoding))
        return data.reshape(-1)


class _Reduction:
    """One `all_reduce` in flight: its buffers and its stages, each started by the previous one's
    completion. Only the reduce stage reaches the state, through a weak reference, and the stage that
    completes the future touches neither the state nor its process group: gloo runs these stages on
    its own threads, and a process group freed there would join its thread from itself (a crash at
    teardown, when the last reference goes right after the future completes)."""

    def __init__(
        self, state: FP8CommState, seq: int, tensor: torch.Tensor, sent: torch.Tensor, key: Any,
        layout: tuple, result: torch.futures.Future,
    ) -> None:  # fmt: skip
        self.state = weakref.ref(state)
        self.launcher = state._launcher
        self.seq = seq
        self.tensor = tensor
        self.sent = sent
        self.received = torch.empty_like(sent)
        self.mean: Optional[torch.Tensor] = None  # this rank's mean shard, encoded
        self.gathered: Optional[torch.Tensor] = None
        self.key = key
        self.layout = layout
        self.result = result
        self.world_size = state.world_size
        self.timeout = state.timeout
        self.shard = -(-tensor.numel() // state.world_size)
        self.decode_return = functools.partial(
            _decode_return, state.return_format, state.chunk_size, state.encoding, self.shard
        )

    def start(self) -> None:
        self.launcher.submit(self.seq, self._launch_scatter)

    def _fail(self, error: BaseException, release_gather: bool, stage: str) -> None:
        if release_gather:  # later collectives must not wait for this return trip
            self.launcher.submit(self.seq + 1, lambda: None)
        if not self.result.done():
            named = RuntimeError(
                f"fp8_allreduce_hook: the {stage} of bucket {self.key} failed on FP8CommState's process "
                f"group (timeout {self.timeout if self.timeout is not None else 'torch default'}): "
                f"{error}. A rank that stalls past the group's timeout, or stops, ends the step's "
                "backward with this error on the others"
            )
            named.__cause__ = error
            self.result.set_exception(named)

    def _live_state(self) -> FP8CommState:
        state = self.state()
        if state is None:
            raise RuntimeError("the FP8CommState was freed while its reductions were in flight")
        return state

    def _launch_scatter(self) -> None:
        try:
            group = self._live_state().group
            work = dist.all_to_all_single(self.received, self.sent, group=group, async_op=True)
            del group
            work.get_future().then(self._reduce)
        except BaseException as error:  # noqa: BLE001 (reported through the future)
            self._fail(error, release_gather=True, stage="all_to_all (launch)")

    def _reduce(self, scattered: torch.futures.Future) -> None:
        try:
            scattered.wait()
        except BaseException as error:  # noqa: BLE001
            self._fail(error, release_gather=True, stage="all_to_all")
            return
        try:
            self.mean = self._live_state()._reduce_shard(
                self.received, self.shard, self.key, self.layout, self.tensor.device
            )
            self.gathered = self.mean.new_empty(self.world_size * self.mean.numel())
        except BaseException as error:  # noqa: BLE001
            self._fail(error, release_gather=True, stage="reduction of its shard")
            return
        self.launcher.submit(self.seq + 1, self._launch_gather)

    def _launch_gather(self) -> None:
        # no reference to the group may outlive this frame once the future can complete: the
        # callback is attached after the group is let go (an already completed gather runs it here)
        try:
            group = self._live_state().group
            work = _all_gather(self.gathered, self.mean, group)
            del group
            work.get_future().then(self._finish)
        except BaseException as error:  # noqa: BLE001
            self._fail(error, release_gather=False, stage="all_gather (launch)")

    def _finish(self, gathered: torch.futures.Future) -> None:
        try:
            gathered.wait()
        except BaseException as error:  # noqa: BLE001
            self._fail(error, release_gather=False, stage="all_gather")
            return
        try:
            rows = self.decode_return(self.gathered.view(self.world_size, -1))
            with torch.no_grad():
                self.tensor.copy_(rows.reshape(-1)[: self.tensor.numel()].view_as(self.tensor))
            self.result.set_result(self.tensor)
        except BaseException as error:  # noqa: BLE001
            self._fail(error, release_gather=False, stage="decoding of the gathered mean")


def _decode_return(
    return_format: str, chunk: int, encoding: str, shard: int, rows: torch.Tensor
) -> torch.Tensor:
    """The gathered mean shards [W, bytes] as float32 [W, shard]."""
    if return_format == "bf16":
        return rows.view(torch.bfloat16).float()
    return wire.decode(rows, shard, chunk, encoding)


def _all_gather(output: torch.Tensor, data: torch.Tensor, group) -> Any:
    """all_gather_single (torch >= 2.13; all_gather_into_tensor, its old name, is deprecated there)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, data, group=group, async_op=True)


def fp8_allreduce_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the ranks with FP8 on the wire, float32 sums,
    the same bits on every rank. `ddp.register_comm_hook(FP8CommState(...), fp8_allreduce_hook)`.

    Args:
        state: the `FP8CommState` DDP hands back (its group, format and options, error feedback).
        bucket: the gradient bucket DDP hands the hook.

    Returns:
        A future of the bucket's averaged gradients (float32 sums, in the bucket's dtype), as DDP
        expects of a communication hook.
    """
    layout = tuple((id(p), p.numel()) for p in bucket.parameters())
    return state.all_reduce(bucket.buffer(), key=bucket.index(), layout=layout)
