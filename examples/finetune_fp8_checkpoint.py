"""Fine-tune a block-FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 layout) with LoRA on 2 CPU ranks, in FP8.

    python examples/finetune_fp8_checkpoint.py                 # 2 gloo ranks (DDP), 8 steps
    python examples/finetune_fp8_checkpoint.py --steps 20 --ranks 1

Nothing is downloaded. It writes a small FP8 checkpoint first: a tiny Llama built from transformers'
LlamaConfig (fp8train.tools.bench.fp8_checkpoint.write_checkpoint), every linear but lm_head quantized
by the format's rule (per 128x128 block s = amax / 448, values w / s in E4M3, `weight_scale_inv` = s).
Then each rank loads it with its linears as frozen FP8 layers (fp8train.StoredFP8Linear: the stored
bytes, no high-precision copy), adds PEFT LoRA adapters, trains them under DDP and Float8BlockScaling
on the bytes of the Python standard library's source, and rank 0 exports the merged model in the same
format and loads the export with transformers.
Needs `pip install "fp8train[hf,peft]"`. docs/guide.md, "Fine-tuning an FP8 checkpoint".
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import tempfile

import torch

import fp8train
from fp8train.tools.bench.fp8_checkpoint import write_checkpoint
from fp8train.tools.ranks import run_ranks

SEQ, BATCH = 64, 4


def batches(rank: int, steps: int) -> torch.Tensor:
    root, data = sysconfig.get_paths()["stdlib"], bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and len(data) < 500_000:
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
    text = torch.frombuffer(data, dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(rank)
    starts = torch.randint(0, len(text) - SEQ, (steps, BATCH), generator=g)
    return text[starts[..., None] + torch.arange(SEQ)]


def base_weight_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters, weight bytes, scale bytes) of the model's frozen FP8 layers."""
    layers = [m for m in model.modules() if isinstance(m, fp8train.StoredFP8Linear)]
    params = sum(m.weight.numel() for m in layers)
    weights = sum(m.weight.untyped_storage().nbytes() for m in layers)
    return params, weights, sum(m.weight_scale_inv.untyped_storage().nbytes() for m in layers)


def train(rank: int, world_size: int, directory: str, steps: int) -> dict:
    import peft
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8train.integrations.fp8_checkpoint import (
        exclude_stored_from_ddp,
        export_fp8_checkpoint,
        load_fp8_checkpoint,
    )
    from fp8train.integrations.peft_fp8 import lora_config

    recipe = fp8train.Float8BlockScaling()
    torch.manual_seed(0)
    model = load_fp8_checkpoint(directory, recipe)
    config = lora_config(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(model, config)
    ddp = DDP(exclude_stored_from_ddp(model)) if world_size > 1 else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for ids in batches(rank, steps):
        with fp8train.autocast(recipe=recipe):
            loss = ddp(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "bytes": base_weight_bytes(model)}
    if rank == 0:
        out = os.path.join(directory, "export")
        export_fp8_checkpoint(model, out, recipe)
        result["export"] = out
    if world_size > 1:
        dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(directory, hidden=256, intermediate=512, layers=2, positions=SEQ)
        results = run_ranks(train, args.ranks, directory, args.steps, timeout_s=600)
        for step, losses in enumerate(zip(*(r["losses"] for r in results))):
            print(f"step {step:3d}  loss per rank " + "  ".join(f"{x:.4f}" for x in losses))
        params, weights, scales = results[0]["bytes"]
        print(
            f"base weights: {params:,} parameters in {weights:,} bytes of FP8 + {scales:,} bytes of "
            f"scales = {(weights + scales) / params:.4f} bytes/parameter (bf16: 2, fp32: 4)"
        )
        from transformers import AutoModelForCausalLM

        from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint

        export = results[0]["export"]
        reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # dequantizes on CPU
        ours = load_fp8_checkpoint(export)
        ids = batches(1000, 1)[0]
        with torch.no_grad():
            difference = (reloaded(ids).logits - ours(ids).logits).abs().max().item()
        print(
            f"export reloaded by transformers ({type(reloaded).__name__}): "
            f"max |logits - fp8train's| = {difference:.2e}"
        )


if __name__ == "__main__":
    main()
