"""The header every amax reduction carries (docs/design.md, section 3): its fields, how a rank writes
it on the device, and the error a disagreement becomes.

Each quantity q is sent as (q, -q), so one MAX all-reduce gives the group's max and min of it: ranks
agree iff max == min for every field.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from ..errors import LayoutMismatchError, StateMismatchError
from .storage import DIGEST_PRIME, ScalingStorage, bits_mod_p

__all__ = ["HEADER_FIELDS", "HEADER_LEN", "Header", "Member", "state_digest", "mismatch_error"]


class Member(Protocol):
    """What the wire needs of a direction reduced on a channel (reduction.Direction): its names for
    messages. The channel never calls it: reduction.py finishes what the channel names."""

    name: str
    recipe_key: str

    def describe(self) -> str: ...


HEADER_FIELDS = (
    "layout_hi",  # two 24-bit halves of the layout fingerprint: direction, recipe, modules in
    "layout_lo",  # order and the roles that recorded
    "roles",
    "modules",
    "roles_recorded",
    "training_region",  # the amax group's own index of the region these amaxes belong to
    "wire",  # values this rank sends after the header
    "state_hi",  # two 24-bit digests of the scales and amax histories: ranks must hold the same
    "state_lo",  # FP8 state
)
HEADER_LEN = 2 * len(HEADER_FIELDS)
_STATE_FIELDS = {"state_hi", "state_lo"}


def state_digest(storage: ScalingStorage, weights: torch.Tensor) -> torch.Tensor:
    """Two 24-bit digests (float32) of a direction's scales, inverse scales and history digests.

    Integer arithmetic modulo a prime: exact and identical on every device for the same bits."""
    parts = torch.stack([bits_mod_p(storage.scale), bits_mod_p(storage.scale_inv), storage.digest])
    return ((weights * parts.unsqueeze(0)) % DIGEST_PRIME).sum(dim=(1, 2)).remainder(DIGEST_PRIME).float()


def _digest_weights(n: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 2**24, (2, 3, n), generator=generator, dtype=torch.int64).to(device)


class Header:
    """One direction's header: its layout fingerprint, and the device tensors that make writing it in
    a steady step copy nothing from the host."""

    def __init__(self, direction: str, recipe_key: str) -> None:
        # The recipe seeds the layout fingerprint: ranks with different recipes (margin, history
        # length, algorithms) would otherwise reduce happily and silently compute different scales.
        self._layout = hashlib.blake2b(f"{direction} {recipe_key}".encode(), digest_size=8).digest()
        self._static: dict[tuple, torch.Tensor] = {}  # recorded columns -> fields 0-4, on the device
        self._weights: Optional[torch.Tensor] = None  # state digest weights for the current size

    def add_member(self, signature: str) -> None:
        self._layout = hashlib.blake2b(self._layout + signature.encode(), digest_size=8).digest()
        self._static.clear()
        self._weights = None

    def write(
        self, storage: ScalingStorage, members: int, columns: tuple, region_index: int, wire: int
    ) -> torch.Tensor:
        """This rank's header for a reduction of `columns`, written on the device."""
        static = self._static.get(columns)
        device = storage.device
        if static is None:  # a new layout or set of recorded roles: once, not every step
            digest = hashlib.blake2b(self._layout + repr(columns).encode(), digest_size=6).digest()
            values = [
                int.from_bytes(digest[:3], "little"),
                int.from_bytes(digest[3:], "little"),
                storage.num_roles,
                members,
                len(columns),
            ]
            static = self._static[columns] = torch.tensor(values, dtype=torch.float32, device=device)
        if self._weights is None:
            self._weights = _digest_weights(storage.num_roles, device)
        # Fills take the numbers as kernel arguments; `dynamic[1] = wire` would copy a host tensor into
        # the element (a blocking host-to-device copy on CUDA, at every launch).
        dynamic = torch.full((2,), float(wire), device=device)
        dynamic[:1].fill_(float(region_index % 2**24))
        q = torch.cat([static, dynamic, state_digest(storage, self._weights)])
        return torch.stack([q, -q], dim=1).flatten()


def mismatch_error(direction: Member, reduced: list[float], local: list[float]) -> LayoutMismatchError:
    """The error for a reduction whose ranks disagreed: `reduced` and `local` are its header as the
    group reduced it and as this rank sent it; `direction` the direction it belongs to."""
    differing = [name for i, name in enumerate(HEADER_FIELDS) if reduced[2 * i] != -reduced[2 * i + 1]]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if differing and set(differing) <= _STATE_FIELDS:
        return StateMismatchError(
            f"FP8 state differs between ranks of the {direction.name} amax group (rank {rank}, "
            f"{direction.describe()}): the ranks run the same modules but hold different scales or "
            "amax histories, so they would train with different FP8 casts. This happens when a "
            "checkpoint was loaded on some ranks only (for example rank 0 loads it, then DDP "
            "broadcasts parameters and buffers, but not FP8 state). Fix: after loading, call "
            "fp8train.broadcast_fp8_state(model, src=0) on every rank, or load the checkpoint on "
            "every rank. No scale was updated from this reduction."
        )
    spans = [
        f"{name}: this rank {int(local[2 * i])}, "
        f"group min {int(-reduced[2 * i + 1])} max {int(reduced[2 * i])}"
        for i, name in enumerate(HEADER_FIELDS)
        if name in differing and not name.startswith(("layout", "state"))
    ]
    return LayoutMismatchError(
        f"FP8 layout mismatch in the {direction.name} amax group (rank {rank}): ranks contributed "
        "different modules, order or sizes, a module or a backward ran on some ranks only, ranks ran "
        "different numbers of training regions, or ranks use different recipes. Differing: "
        f"{', '.join(differing)}{'; ' if spans else ''}{'; '.join(spans)}. This rank has "
        f"{direction.describe()} and recipe ({direction.recipe_key}). Every rank of the amax group "
        "must run the same FP8 modules in the same order under the same recipe, in the same training "
        "regions; no scale was updated. An amax group must not span pipeline stages: give each stage "
        "its own amax group (fp8_group = the data- and tensor-parallel ranks of that stage)."
    )
