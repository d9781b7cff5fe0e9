"""What the framework integration tests share: a tiny Llama, byte-level text, and a spy on the amax wire.

The spy (`AmaxWire`) records every MAX all-reduce that fp8train issues (the amax collectives: DDP's
and FSDP2's gradient collectives do not go through `torch.distributed.all_reduce`, and the frameworks'
own metric reductions are SUM or gathers), with this rank's local buffer before the reduction and the
reduced buffer after its wait. Gathered across ranks, that checks the reduced values are the
elementwise MAX of what the ranks sent, and that the ranks sent different values (different data).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from fp8train.tools.data import stdlib_text
from multirank import AllReduceSpy

SEQ = 32


def integration_marks(extra: str, *modules: str) -> list:
    """A framework test file's marks: multirank, integration, and skipped (not failed) where one of
    `modules` is missing, naming the extra that installs it; find_spec, so that collecting
    (-m "not multirank") stays cheap."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    reason = f'needs {missing}: pip install "fp8train[{extra}]"'
    return [pytest.mark.multirank, pytest.mark.integration, pytest.mark.skipif(bool(missing), reason=reason)]


def tiny_llama(seed: int):
    """LlamaForCausalLM from a config (no download): hidden 64, 2 layers, vocab 256 (bytes); every
    GEMM dimension a multiple of 16, so every linear layer, lm_head included, converts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class ByteText(torch.utils.data.Dataset):
    """Windows of the standard library's source, byte-level: offline, the same on every machine."""

    def __init__(self, n: int, seed: int) -> None:
        text = stdlib_text(200_000)
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(text) - SEQ, (n,), generator=g)
        self.windows = text[starts[:, None] + torch.arange(SEQ)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i].clone()}


def set_launcher_env(rank: int, world_size: int) -> None:
    """What torchrun sets, so that accelerate / Lightning see this rank of an external launch (the
    process group itself is already initialised by run_ranks, and they reuse it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        TORCHELASTIC_RUN_ID="fp8train-test",
    )


class _RecordingWork:
    def __init__(self, work: Any, done) -> None:
        self.work, self.done = work, done

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        self.done()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class AmaxWire(AllReduceSpy):
    """AllReduceSpy that keeps (local, reduced) of every MAX all-reduce: fp8train's amax collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[list[Optional[torch.Tensor]]] = []

    @property
    def amax_calls(self) -> int:
        return len(self.records)

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        if op != dist.ReduceOp.MAX:
            return super()._all_reduce(tensor, op=op, group=group, async_op=async_op)
        entry: list[Optional[torch.Tensor]] = [tensor.detach().clone(), None]
        self.records.append(entry)

        def done() -> None:
            if entry[1] is None:
                entry[1] = tensor.detach().clone()

        work = super()._all_reduce(tensor, op=op, group=group, async_op=True)
        if not async_op:
            work.wait()
            done()
            return None
        return _RecordingWork(work, done)


def check_wire(records_per_rank: list[list]) -> None:
    """Every amax collective: the same count on each rank, reduced == MAX of the ranks' local
    buffers on every rank, and the local buffers of the ranks differed (different data) somewhere."""
    counts = {len(r) for r in records_per_rank}
    assert len(counts) == 1, f"ranks issued different numbers of amax collectives: {counts}"
    differed = 0
    for i in range(counts.pop()):
        locals_ = torch.stack([r[i][0] for r in records_per_rank])
        expected = locals_.max(dim=0).values
        for rank, r in enumerate(records_per_rank):
            assert r[i][1] is not None, f"rank {rank}: collective {i} was never waited on"
            assert torch.equal(r[i][1], expected), f"collective {i}: rank {rank} did not get the MAX"
        differed += int(not torch.equal(locals_[0], locals_[1]))
    assert differed > 0, "the ranks sent identical amaxes: the test's data does not differ between ranks"


def assert_same_state(a: list, b: list, what: str) -> None:
    """Two `helpers.fp8_state` snapshots hold the same tensors."""
    assert len(a) == len(b) and a, what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: FP8 module {i // 6} differs"


def assert_ends_near_the_run_without_fp8(
    first: float, final: float, reference: float, tolerance: float
) -> None:
    """The FP8 run's loss fell from `first` to `final` (by 0.3 nats at least) and ends within `tolerance`
    (relative) of the same run's final loss without FP8, `reference`."""
    assert final < first - 0.3, (first, final)
    gap = abs(final - reference) / reference
    assert gap < tolerance, (final, reference, gap)


def assert_trained(state: list) -> None:
    """FP8 casts really happened: every module's input and weight histories (the first of the six
    tensors `helpers.fp8_state` holds per module) recorded amaxes."""
    for i, fwd_history in enumerate(state[::6]):
        assert fwd_history[0, :2].gt(0).all(), f"FP8 module {i} recorded no input/weight amax"
