"""FP8 gradient communication: a DDP communication hook with FP8 on the wire, float32 sums and the
same bits on every rank (docs/design.md, section 15; the guide's "FP8 gradient communication").

    state = fp8train.comm.FP8CommState()          # after init_process_group, on every rank
    ddp.register_comm_hook(state, fp8train.comm.fp8_allreduce_hook)
    fp8train.comm.use_fp8_reduce_scatter(fsdp_model)  # FSDP2: the reduce-scatter, FP8 on the wire
"""

from __future__ import annotations

from . import wire
from .ddp import FP8CommState, fp8_allreduce_hook, fp8_encoding
from .fsdp import FP8ReduceScatter, use_fp8_reduce_scatter

__all__ = [
    "FP8CommState",
    "fp8_allreduce_hook",
    "fp8_encoding",
    "FP8ReduceScatter",
    "use_fp8_reduce_scatter",
    "wire",
]
