"""torchtitan's MoE experts (`GroupedExperts`: 3-D weights, token counts per expert) converted by
`FP8TrainConverter`: the config tree of its Qwen3 MoE debug model, and the module on its own (its full
debug model, 64 experts of 768 x 256 in 8 layers, is too large for the CPU suite)."""

from __future__ import annotations

import pytest
import torch

moe = pytest.importorskip(
    "torchtitan.models.common.moe",
    reason='needs torchtitan (pip install "fp8train[torchtitan]"; triton on CPU)',
)

import fp8train  # noqa: E402
from fp8train.integrations.torchtitan import FP8GroupedExperts, FP8TrainConverter  # noqa: E402

pytestmark = pytest.mark.integration
DIM, HIDDEN, EXPERTS = 32, 64, 4


def test_converter_swaps_every_experts_config_of_the_qwen3_moe_model() -> None:
    from torchtitan.models import qwen3

    config = qwen3.model_registry("debugmodel_moe", converters=[FP8TrainConverter.Config()]).model
    found = list(config.traverse(moe.GroupedExperts.Config))
    assert len(found) == 8 and all(type(c) is FP8GroupedExperts.Config for _, c, _, _ in found)
    assert all(c.num_experts == 64 and c.dim == 256 and c.hidden_dim == 768 for _, c, _, _ in found)


def _pair():
    torch.manual_seed(0)
    plain = moe.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS).build()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.2)
    fp8 = FP8GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS).build()
    fp8.load_state_dict(plain.state_dict(), strict=False)  # no FP8 extra state in the plain one
    return plain, fp8


def test_outside_a_region_it_is_torchtitans_forward_bit_for_bit() -> None:
    plain, fp8 = _pair()
    x, counts = torch.randn(20, DIM), torch.tensor([5, 0, 11, 4])
    assert torch.equal(plain(x, counts), fp8(x, counts))
    assert fp8.num_gemms == 3 * EXPERTS and len(fp8train.coverage(fp8).layers) == 3 * EXPERTS


def test_in_fp8_each_expert_equals_fp8_linears_bit_for_bit() -> None:
    """silu(x w1_e.T) * (x w3_e.T) then w2_e, per expert, as fp8train.Linear layers with the same
    weights run it: outputs, input and weight gradients, over steps with delayed scales."""
    torch.set_num_threads(1)
    _, fp8 = _pair()
    linears = {}
    for name, weight in (("w1", fp8.w1_EFD), ("w3", fp8.w3_EFD), ("w2", fp8.w2_EDF)):
        linears[name] = []
        for e in range(EXPERTS):
            lin = fp8train.Linear(weight.shape[2], weight.shape[1], bias=False)
            with torch.no_grad():
                lin.weight.copy_(weight[e])
            linears[name].append(lin)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    counts = [6, 0, 9, 5]
    for step in range(3):
        x = torch.randn(sum(counts), DIM) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8train.fp8_autocast(fp8_recipe=recipe):
            ya = fp8(xa, torch.tensor(counts))
            parts = []
            for e, part in enumerate(xb.split(counts)):
                h = torch.nn.functional.silu(linears["w1"][e](part)) * linears["w3"][e](part)
                parts.append(linears["w2"][e](h))
            yb = torch.cat(parts)
        assert torch.equal(ya, yb), step
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad), step
        for name, weight in (("w1", fp8.w1_EFD), ("w3", fp8.w3_EFD), ("w2", fp8.w2_EDF)):
            for e in range(EXPERTS):
                assert torch.equal(weight.grad[e], linears[name][e].weight.grad), (step, name, e)
                linears[name][e].weight.grad = None
        fp8.zero_grad()
    hist = fp8.fp8_meta["scaling_fwd"].amax_history
    assert hist[0, 3 * 1] == 0 and hist[0, 3 * 0] > 0  # expert 1 (no token): its w1 input never rolled


def _fsdp_titan_experts(rank: int, world: int) -> dict:
    """FP8GroupedExperts (3 experts: uneven over 2 ranks) sharded by FSDP2, without and with
    fsdp_fp8_all_gather, trained 3 steps on per-rank tokens (an expert empty on rank 0)."""
    from torch.distributed.fsdp import fully_shard

    from multirank import train_fsdp_gathers

    torch.set_num_threads(1)

    def shard(option: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        experts = FP8GroupedExperts.Config(
            dim=DIM, hidden_dim=HIDDEN, num_experts=3, fsdp_fp8_all_gather=option
        ).build()
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.2)
        fully_shard(experts)
        return experts

    def loss_of(experts: torch.nn.Module, step: int) -> torch.Tensor:
        counts = torch.tensor([4, 0, 6] if rank == 0 else [3, 5, 2])
        x = torch.randn(10, DIM, generator=torch.Generator().manual_seed(10 * rank + step))
        return experts(x, counts).square().mean()

    return train_fsdp_gathers(shard, loss_of)


@pytest.mark.multirank
def test_fsdp2_gathers_torchtitan_experts_in_fp8_bit_for_bit() -> None:
    from multirank import assert_fp8_gathers_bit_for_bit, run_ranks

    assert_fp8_gathers_bit_for_bit(run_ranks(_fsdp_titan_experts, 2, timeout_s=180, pg_timeout_s=60))
