"""A small GPT trained in FP8 with tensor parallelism (TP=2) inside data parallelism (DP=2), on CPU.

    torchrun --nproc_per_node 4 examples/tp_dp_gpt.py [--sequence-parallel] [--steps 60]

Ranks {0,1} and {2,3} are the TP groups, {0,2} and {1,3} the DP groups (DDP), and the amax group is
all four ranks: it must contain every TP group (fp8train checks it) and no pipeline stage boundary.
The data is byte-level text from this Python installation's own standard library sources (no
download), each DP rank reading its own windows. Every `--log-every` steps rank 0 prints the loss
and whether all four ranks hold bit-identical FP8 scales; at the end, the collectives of one step.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8train as ft
from fp8train import tensor_parallel
from fp8train.tools.data import stdlib_text

HIDDEN, HEADS, FFN, LAYERS, SEQ, BATCH, VOCAB = 64, 4, 256, 2, 64, 8, 256


class Attention(torch.nn.Module):
    """Causal self-attention over this rank's heads: qkv column-parallel (each rank's rows hold whole
    heads: the weight is laid out head by head, q k v within a head), proj row-parallel."""

    def __init__(self, tp_group, sp: bool) -> None:
        super().__init__()
        self.local_heads = HEADS // dist.get_world_size(tp_group)
        self.qkv = ft.LayerNormLinear(HIDDEN, 3 * HIDDEN, tp_group=tp_group, sequence_parallel=sp)
        self.proj = ft.Linear(HIDDEN, HIDDEN, tp_group=tp_group, parallel_mode="row", sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [seq (or this rank's part), batch, hidden]
        qkv = self.qkv(x)  # [seq, batch, 3 * hidden / tp]: under SP the whole sequence, gathered in FP8
        t, b, _ = qkv.shape
        q, k, v = qkv.view(t, b, self.local_heads, 3, HIDDEN // HEADS).permute(3, 1, 2, 0, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, dim]
        return self.proj(y.permute(2, 0, 1, 3).reshape(t, b, -1))


class GPT(torch.nn.Module):
    def __init__(self, tp_group, sp: bool) -> None:
        super().__init__()
        self.tp_group, self.sp = tp_group, sp
        self.tok_emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos_emb = torch.nn.Embedding(SEQ, HIDDEN)
        self.attn = torch.nn.ModuleList(Attention(tp_group, sp) for _ in range(LAYERS))
        self.mlp = torch.nn.ModuleList(
            ft.LayerNormMLP(HIDDEN, FFN, tp_group=tp_group, sequence_parallel=sp) for _ in range(LAYERS)
        )
        self.ln_f = ft.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        if sp:  # replicated parameters applied to this rank's tokens: partial gradients
            for p in [*self.tok_emb.parameters(), *self.pos_emb.parameters(), *self.ln_f.parameters()]:
                p.sequence_parallel = True
            self.head.weight.sequence_parallel = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: [batch, seq]
        x = (self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))).transpose(0, 1)
        if self.sp:  # this rank's part of the sequence
            x = x.chunk(dist.get_world_size(self.tp_group))[dist.get_rank(self.tp_group)]
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x)
            x = x + mlp(x)
        return self.head(self.ln_f(x))  # [seq (or this rank's part), batch, vocab]


def batch(text: torch.Tensor, dp_rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * dp_rank + step)
    starts = torch.randint(0, len(text) - SEQ - 1, (BATCH,), generator=g)
    return torch.stack([text[s : s + SEQ + 1] for s in starts.tolist()])


def train(steps: int, sp: bool, log_every: int = 10, lr: float = 3e-3) -> dict:
    """The training loop on an initialised 4-rank process group; returns rank 0's losses and checks."""
    rank, tp = dist.get_rank(), 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
    torch.manual_seed(0)  # every rank draws the same whole weights and keeps its shards
    model = GPT(tp_group, sp)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    recipe = ft.DelayedScaling(amax_history_len=16)
    text, losses, identical = stdlib_text(), [], []
    for step in range(steps):
        tokens = batch(text, rank // tp, step)
        with ft.fp8_autocast(fp8_recipe=recipe):  # amax group: all ranks (contains both TP groups)
            logits = ddp(tokens[:, :-1])
        targets = tokens[:, 1:].transpose(0, 1)
        if sp:
            targets = targets.chunk(tp)[rank % tp]
        # each TP rank's loss covers its tokens; the TP ranks' losses add up to the mean over all
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1), reduction="sum")
        loss = loss / (SEQ * BATCH)
        loss.backward()
        ft.reduce_sequence_parallel_grads(model, tp_group)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        if sp:
            dist.all_reduce(whole, group=tp_group)
        losses.append(whole.item())
        if step % log_every == 0 or step == steps - 1:
            identical.append(_scales_identical(model))
            if rank == 0:
                print(
                    f"step {step:4d}  loss {losses[-1]:.4f}  scales identical on all ranks: {identical[-1]}"
                )
    return {"losses": losses, "identical": identical, "collectives": _count_one_step(ddp, text, recipe, sp)}


def _scales_identical(model: torch.nn.Module) -> bool:
    h = hashlib.sha256()
    for m in model.modules():
        if isinstance(m, ft.FP8Module):
            for key in ("scaling_fwd", "scaling_bwd"):
                h.update(m.fp8_meta[key].scale.numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


def _count_one_step(ddp, text, recipe, sp: bool) -> dict:
    """The collectives of one more step (forward, backward, reduce_sequence_parallel_grads)."""
    counts: dict[str, int] = {}
    saved = (tensor_parallel._all_gather, tensor_parallel._reduce_scatter, dist.all_reduce)

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    tensor_parallel._all_gather = counted("tp all_gather", saved[0])
    tensor_parallel._reduce_scatter = counted("tp reduce_scatter", saved[1])
    dist.all_reduce = counted("all_reduce (TP sums, amax, SP grads)", saved[2])
    try:
        tokens = batch(text, 0, 10**6)
        with ft.fp8_autocast(fp8_recipe=recipe):
            logits = ddp(tokens[:, :-1])
        logits.float().square().mean().backward()  # DDP's own bucket all-reduces are not counted here
        ft.reduce_sequence_parallel_grads(ddp.module, ddp.module.tp_group)
        ft.synchronize()
    finally:
        tensor_parallel._all_gather, tensor_parallel._reduce_scatter, dist.all_reduce = saved
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run with 4 ranks: torchrun --nproc_per_node 4 examples/tp_dp_gpt.py")
    result = train(args.steps, args.sequence_parallel, args.log_every)
    if dist.get_rank() == 0:
        print(f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}; one step's collectives:")
        for name, n in sorted(result["collectives"].items()):
            print(f"  {name}: {n}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
