"""Which stream the FP8 state's device work is queued on (docs/design.md, section 6).

On CUDA a reduction's buffer is allocated on the stream that launched it (the compute stream) and
the caching allocator hands its block to that stream again once it is freed: whatever reads it must
run on that stream, or the block may be reused while the read is still queued elsewhere. FSDP2
(`fsdp_fp8_all_gather`) asks for a weight's scale inside its all-gather, on its copy-in stream;
`queued_on` then queues the reduction's wait and update back on the launch stream and makes the
caller's stream wait for them. On the CPU there are no streams and all of this is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

__all__ = ["current_stream", "use_stream", "queued_on"]


def current_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The stream `device`'s work is queued on now (None off CUDA)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def use_stream(stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
    """Queue the block's work on `stream` (and its device's)."""
    return torch.cuda.stream(stream)


@contextlib.contextmanager
def queued_on(device: torch.device, stream: Optional[torch.cuda.Stream]) -> Iterator[None]:
    """Run the block's device work on `stream` (the one that owns the tensors it reads), then make the
    caller's stream wait for it; nothing to do when the caller is on `stream` already or off CUDA."""
    caller = current_stream(device)
    if stream is None or caller is None or caller == stream:
        yield
        return
    with use_stream(stream):
        yield
    caller.wait_stream(stream)
