"""AdamW whose moments are FP8 blocks and whose master weight can be a bf16 weight plus one byte.

Bytes of optimizer state per parameter (scales included, `state_bytes`): 2.11 for the two moments
(one E4M3 byte each, three float32 block figures per 128: the first moment's scale, the second's
maximum and exponent), plus the master: none for float32 parameters (the parameter is the master),
4 for a float32 master of bf16 parameters, 1 (the remainder) for `master="bf16"`. With the gradient
and the parameter that makes 10.11 bytes for float32 (AdamW: 16) and 7.11 for bf16 + remainder.

The update is AdamW's (torch.optim.AdamW, decoupled weight decay, bias correction) computed in
float32 from the decoded state, over chunks of parameters at once: each chunk's blocks are
concatenated, updated with one set of tensor ops and written back, so the op count grows with the
number of chunks (`chunk_elements`), not of parameters; the float32 temporaries are a few times the
chunk's size. Works on plain tensors and DTensors (FSDP2: each rank updates its shard) on any
device. Randomness (stochastic rounding) comes from a generator seeded by (seed, step, parameter
index), so a resumed run is bit for bit the uninterrupted one.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

import torch

from ..torch_internals import foreach_copy
from . import codecs

__all__ = ["AdamW", "state_bytes"]

MASTERS = ("fp32", "bf16")
SECOND_MOMENTS = ("expanded", "sqrt", "linear")
ENCODING_KEY = "fp8train_encoding"  # in each saved param group: the options the state was stored with
_PARAM_DTYPES = {"fp32": (torch.float32, torch.bfloat16, torch.float16), "bf16": (torch.bfloat16,)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with FP8 moments.

    master: "fp32" (float32 parameters are their own master; bf16/fp16 ones get a float32 master in
    the state) or "bf16" (bf16 parameters plus an 8-bit remainder: 16 significant bits, rounded
    stochastically). second_moment: "expanded" (default) stores v through COAT's dynamic range
    expansion (`codecs.encode_expanded`), "sqrt" stores sqrt(v) (one E4M3 block then spans 2**35 of
    v), "linear" v itself; docs/guide.md, "Saving memory", has the measurement behind the default.
    stochastic=False rounds to nearest (a negative control: the moments then stall).

    Args:
        params: the parameters (or parameter groups), as torch.optim.AdamW's.
        lr: the learning rate (>= 0).
        betas: the moments' decay rates, two numbers in [0, 1).
        eps: added to the second moment's square root (>= 0).
        weight_decay: decoupled weight decay (>= 0), as torch.optim.AdamW's.
        master: "fp32" or "bf16", as above.
        second_moment: "expanded", "sqrt" or "linear", as above.
        stochastic: round the FP8 moments (and the bf16 master's remainder) stochastically.
        seed: the rounding generator's seed (the same seed, the same rounding).
        chunk_elements: elements updated per pass (bounds the temporaries; >= one block).

    Raises:
        ValueError: an argument out of its range (the message names it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master: str = "fp32",
        second_moment: str = "expanded",
        stochastic: bool = True,
        seed: int = 0,
        chunk_elements: int = 1 << 22,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"fp8train.optim.AdamW: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"fp8train.optim.AdamW: betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(
                f"fp8train.optim.AdamW: eps and weight_decay must be >= 0, got {eps}, {weight_decay}"
            )
        if master not in MASTERS:
            raise ValueError(f"fp8train.optim.AdamW: master={master!r}; use one of {MASTERS}")
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(
                f"fp8train.optim.AdamW: second_moment={second_moment!r}; use one of {SECOND_MOMENTS}"
            )
        if chunk_elements < codecs.BLOCK:
            raise ValueError(f"fp8train.optim.AdamW: chunk_elements must be >= {codecs.BLOCK}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master, self.second_moment, self.stochastic = master, second_moment, stochastic
        self.seed, self.chunk_elements = int(seed), int(chunk_elements)
        for index, p in enumerate(self._params()):
            if p.dtype not in _PARAM_DTYPES[master]:
                allowed = ", ".join(str(d) for d in _PARAM_DTYPES[master])
                raise TypeError(
                    f"fp8train.optim.AdamW(master={master!r}) holds parameters of dtype {allowed}; "
                    f"parameter {index} is {p.dtype}"
                    + (" (use master='fp32' for other floating dtypes)" if master == "bf16" else "")
                )

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ---- state -------------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        local = _local(p)
        rows = -(-local.numel() // codecs.BLOCK)
        zeros = torch.zeros(rows, codecs.BLOCK, dtype=torch.float8_e4m3fn, device=local.device)
        ones = torch.ones(rows, 1, device=local.device)
        state = {
            "step": 0,
            "exp_avg": zeros,
            "exp_avg_scale": ones,
            "exp_avg_sq": zeros.clone(),
            "exp_avg_sq_scale": ones.clone(),
        }
        if self.second_moment == "expanded":
            state["exp_avg_sq_exponent"] = ones.clone()
        if self.master == "bf16":
            state["remainder"] = torch.zeros(local.shape, dtype=torch.uint8, device=local.device)
        elif local.dtype != torch.float32:
            state["master"] = local.detach().float().clone()
        return state

    def _master(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        local = _local(p).detach()
        if "remainder" in state:
            return codecs.join_master(local, state["remainder"])
        return state["master"] if "master" in state else local

    def _encode_second(self, v: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        if self.second_moment == "expanded":
            codes, high, k = codecs.encode_expanded(v, gen, self.stochastic)
            return {"exp_avg_sq": codes, "exp_avg_sq_scale": high, "exp_avg_sq_exponent": k}
        stored = v.sqrt() if self.second_moment == "sqrt" else v
        codes, scale = codecs.encode_blocks(stored, gen, self.stochastic, positive=True)
        return {"exp_avg_sq": codes, "exp_avg_sq_scale": scale}

    def _decode_second(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        codes, scale = stored["exp_avg_sq"], stored["exp_avg_sq_scale"]
        if self.second_moment == "expanded":
            return codecs.decode_expanded(codes, scale, stored["exp_avg_sq_exponent"])
        decoded = codecs.decode_blocks(codes, scale)
        return decoded.square_() if self.second_moment == "sqrt" else decoded

    # ---- the update --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Any] = None) -> Optional[torch.Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            chunk, size = [], 0
            for p in group["params"]:
                if p.grad is not None and _local(p).numel():
                    if p.grad.is_sparse:
                        raise RuntimeError("fp8train.optim.AdamW does not take sparse gradients")
                    chunk.append((index, p))
                    size += _local(p).numel()
                    if size >= self.chunk_elements:
                        self._update(group, chunk)
                        chunk, size = [], 0
                index += 1
            if chunk:
                self._update(group, chunk)
        return loss

    def _update(self, group: dict, chunk: list[tuple[int, torch.Tensor]]) -> None:
        beta1, beta2 = group["betas"]
        states = []
        for _, p in chunk:
            if not self.state[p]:
                self.state[p] = self._init_state(p)
            self.state[p]["step"] += 1
            states.append(self.state[p])
        first_index, first = chunk[0][0], states[0]
        device = _local(chunk[0][1]).device
        gen = torch.Generator(device=device)
        gen.manual_seed(hash((self.seed, first["step"], first_index)) & (2**63 - 1))

        rows = [s["exp_avg"].shape[0] for s in states]
        grad = torch.cat([codecs.to_blocks(_local(p.grad).detach().reshape(-1).float()) for _, p in chunk])
        joined = {key: torch.cat([s[key] for s in states]) for key in states[0] if key.startswith("exp_avg")}
        m = codecs.decode_blocks(joined["exp_avg"], joined["exp_avg_scale"])
        v = self._decode_second(joined)
        m.lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

        # per-row bias corrections: parameters of a chunk may have taken different numbers of steps
        steps = [s["step"] for s in states]
        if len(set(steps)) == 1:
            c1, c2 = 1.0 - beta1 ** steps[0], 1.0 - beta2 ** steps[0]
        else:
            c1 = torch.cat([torch.full((r, 1), 1.0 - beta1**t, device=device) for r, t in zip(rows, steps)])
            c2 = torch.cat([torch.full((r, 1), 1.0 - beta2**t, device=device) for r, t in zip(rows, steps)])
        denom = (v / c2).sqrt_().add_(group["eps"])
        update = (m / c1).div_(denom)

        masters = torch.cat(
            [codecs.to_blocks(self._master(p, s).reshape(-1)) for (_, p), s in zip(chunk, states)]
        )
        masters.mul_(1.0 - group["lr"] * group["weight_decay"]).sub_(update, alpha=group["lr"])

        m_codes, m_scale = codecs.encode_blocks(m, gen, self.stochastic)
        encoded = {"exp_avg": m_codes, "exp_avg_scale": m_scale, **self._encode_second(v, gen)}
        locals_ = [_local(p).detach() for _, p in chunk]
        if self.master == "bf16":
            weight, remainder = codecs.split_master(codecs.round_master(masters, gen))
            encoded["remainder"], weights = remainder, weight
        else:
            weights = masters
            if "master" in states[0]:
                encoded["master"] = masters
        # write back: one foreach copy per state tensor kind, from row (or element) slices of the chunk
        ends = list(itertools.accumulate(rows))
        row_slices = [slice(e - r, e) for e, r in zip(ends, rows)]
        for key, value in encoded.items():
            if key in ("remainder", "master"):
                parts = [value[b].reshape(-1)[: t.numel()].view(t.shape) for b, t in zip(row_slices, locals_)]
            else:
                parts = [value[b] for b in row_slices]
            foreach_copy([s[key] for s in states], parts)
        parts = [weights[b].reshape(-1)[: t.numel()].view(t.shape) for b, t in zip(row_slices, locals_)]
        foreach_copy(locals_, parts)

    # ---- checkpoints -------------------------------------------------------------------------------
    def _encoding(self) -> dict[str, str]:
        """The options that define what the stored state means (sqrt(v) and v have the same keys,
        dtypes and shapes): recorded in every saved param group, checked on load."""
        return {"master": self.master, "second_moment": self.second_moment}

    def state_dict(self) -> dict:
        """torch's state dict, each param group recording the options that define the stored
        encoding (`ENCODING_KEY`), so that a load under other options is refused by name."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group[ENCODING_KEY] = self._encoding()
        return state_dict

    def _check_encoding(self, param_groups: list[dict]) -> None:
        for number, group in enumerate(param_groups):
            recorded = group.get(ENCODING_KEY)
            if recorded is None:  # a state saved before the options were recorded: keys are checked
                continue
            for option, value in self._encoding().items():
                if recorded.get(option, value) != value:
                    raise ValueError(
                        f"fp8train.optim.AdamW.load_state_dict: the state was saved with "
                        f"{option}={recorded[option]!r} (param group {number}); this optimizer has "
                        f"{option}={value!r}, which would read its stored moments as another quantity: "
                        f"build the optimizer with {option}={recorded[option]!r} to load it"
                    )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load of `state_dict`, then the state tensors restored with their own dtypes (torch
        casts every state tensor to its parameter's floating dtype, which would turn FP8 codes and
        remainders into floats). Raises ValueError for a state made with other options, naming the
        option."""
        self._check_encoding(state_dict["param_groups"])
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        groups = [{k: v for k, v in g.items() if k != ENCODING_KEY} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})
        for i, p in zip(ids, self._params()):
            if i not in saved:
                continue
            expected = self._init_state(p)
            if set(saved[i]) != set(expected):
                raise ValueError(
                    f"fp8train.optim.AdamW.load_state_dict: parameter {i}'s state has keys "
                    f"{sorted(saved[i])}, this optimizer (master={self.master!r}) expects "
                    f"{sorted(expected)}: load it into an optimizer built with the options it was saved with"
                )
            restored = {"step": int(saved[i]["step"])}
            for key, want in expected.items():
                if key == "step":
                    continue
                got = saved[i][key]
                if got.dtype != want.dtype or got.shape != want.shape:
                    raise ValueError(
                        f"fp8train.optim.AdamW.load_state_dict: parameter {i}'s {key!r} is {got.dtype} "
                        f"{tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)} (another parameter "
                        "shape, shard or block size)"
                    )
                restored[key] = got.to(device=want.device).clone()
            self.state[p] = restored


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in `optimizer.state` (tensors only): the figure behind bytes per parameter."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local(value).numel() * _local(value).element_size()
    return total


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> float:
    """`optimizer`'s state bytes per parameter element (local shards): `state_bytes` over the count."""
    count = sum(_local(p).numel() for group in optimizer.param_groups for p in group["params"])
    return state_bytes(optimizer) / max(count, 1)
