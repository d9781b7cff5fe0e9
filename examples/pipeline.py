"""Pipeline parallelism in FP8 with torch.distributed.pipelining, on CPU (gloo).

    torchrun --nproc_per_node 2 examples/pipeline.py [--schedule 1f1b|gpipe] [--amax-reduction step|region]
    torchrun --nproc_per_node 4 examples/pipeline.py     # 2 stages x 2 data-parallel ranks

A byte-level language model (the previous CONTEXT bytes of this Python installation's own standard
library sources predict the next; nothing downloaded) split into 2 stages of fp8train modules. Rank
r runs stage r % 2 of replica r // 2. Each stage has its own amax group, its data-parallel ranks
(`fp8train.pipeline.prepare_stage` checks that the group stays inside the stage and makes each call
of the stage's module one FP8 region, i.e. one per microbatch). With `amax_reduction="step"` (the
default here) each stage reduces its amaxes twice per optimizer step, at the boundary that
`fp8train.end_step_on(opt)` marks, whatever the number of microbatches; `--amax-reduction region`
reduces twice per microbatch. Rank 0 prints the last stage's loss (it receives it) and the amax
reductions of one step.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import fp8train as ft
from fp8train.tools.data import stdlib_text

CONTEXT, EMBED, HIDDEN, FFN, VOCAB, BATCH, MICRO = 8, 16, 128, 256, 256, 64, 4


class First(torch.nn.Module):
    """Stage 0: embed the context bytes, project, one MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, EMBED)
        self.proj = ft.Linear(CONTEXT * EMBED, HIDDEN)
        self.mlp = ft.LayerNormMLP(HIDDEN, FFN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(tokens).flatten(1))
        return x + self.mlp(x)


class Last(torch.nn.Module):
    """Stage 1: one MLP block and the next-byte logits."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = ft.LayerNormMLP(HIDDEN, FFN)
        self.head = ft.LayerNormLinear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(x))


def batch(text: torch.Tensor, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * replica + step)
    starts = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=g)
    windows = torch.stack([text[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, -1]  # contiguous: some torch checks input strides


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def train(steps: int, schedule: str = "1f1b", amax_reduction: str = "step", log_every: int = 10) -> dict:
    """The loop on an initialised process group of 2 x dp ranks; returns this rank's figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage_index, replica, dp = rank % 2, rank // 2, world // 2
    pp_group = [dist.new_group([2 * r, 2 * r + 1]) for r in range(dp)][replica]  # one pipeline
    stage_group = [dist.new_group(list(range(s, world, 2))) for s in range(2)][stage_index]  # its DP ranks
    torch.manual_seed(0)  # every replica starts from the same weights
    modules = [First(), Last()]
    module = modules[stage_index]
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=pp_group)
    recipe = ft.DelayedScaling(amax_history_len=16, amax_reduction=amax_reduction)
    ft.pipeline.prepare_stage(stage, recipe=recipe, amax_reduction_group=stage_group)
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    runner = kind(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    if amax_reduction == "step":
        ft.end_step_on(opt)  # the step boundary: the stage's 2 reductions overlap the optimizer step
    text, losses, identical, launched = stdlib_text(), [], [], []
    for step in range(steps):
        tokens, target = batch(text, replica, step)
        before = ft.reduction_stats(complete=False)["launched"]
        out: list[torch.Tensor] = []
        if stage_index == 0:
            runner.step(tokens)
        else:
            runner.step(target=target, losses=out)
        with torch.no_grad():  # data parallelism within the stage: mean of the replicas' gradients
            for p in module.parameters():
                dist.all_reduce(p.grad, group=stage_group)
                p.grad /= dp
        opt.step()  # with amax_reduction="step": the pre-hook calls ft.end_step() first
        opt.zero_grad()
        launched.append(ft.reduction_stats(complete=False)["launched"] - before)
        loss = torch.stack(out).mean() if out else torch.zeros(())
        dist.broadcast(loss, src=2 * replica + 1, group=pp_group)  # the last stage's loss, for printing
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            identical.append(_stage_scales_identical(module, stage_group))
            if rank == 0:
                print(f"step {step:4d}  loss {losses[-1]:.4f}  stage scales identical: {identical[-1]}")
    ft.synchronize()
    return {"stage": stage_index, "losses": losses, "identical": identical, "launched_per_step": launched}


def _stage_scales_identical(module: torch.nn.Module, group) -> bool:
    h = hashlib.sha256()
    for m in module.modules():
        if isinstance(m, ft.FP8Module):
            for key in ("scaling_fwd", "scaling_bwd"):
                h.update(m.fp8_meta[key].scale.numpy().tobytes())
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, h.hexdigest(), group=group)
    return len(set(digests)) == 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--amax-reduction", choices=("step", "region"), default="step")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() % 2:
        raise SystemExit("run with an even number of ranks: torchrun --nproc_per_node 2 examples/pipeline.py")
    result = train(args.steps, args.schedule, args.amax_reduction, args.log_every)
    if dist.get_rank() == 0:
        per_step = result["launched_per_step"][-1]
        alone = (
            " (one rank per stage: its amax group has nothing to reduce)"
            if dist.get_world_size() == 2
            else ""
        )
        print(
            f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}; amax reductions per step on "
            f"each stage: {per_step}{alone} ({MICRO} microbatches, amax_reduction={args.amax_reduction!r})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
