"""LoRA on a block-FP8 checkpoint: fp8train's stored FP8 base (StoredFP8Linear, Float8BlockScaling)
against transformers' dequantizing load (what it does without FP8 kernels: nn.Linear weights in the
load dtype), the same tiny Llama, the same adapters, step times measured side by side in one run.
Memory: bytes per parameter of the quantized layers' base weights (scales included)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F

from ..timing import interleaved_times, quartiles

BLOCK = 128


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's rule per 128x128 block: s = amax / 448, w / s in E4M3."""
    rows, cols = w.shape
    padded = F.pad(w.float(), (0, -cols % BLOCK, 0, -rows % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    s = blocks.abs().amax(dim=(1, 3)) / 448
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:rows, :cols]
    return q.contiguous(), s


def write_checkpoint(
    directory: str, hidden: int, intermediate: int, layers: int, positions: int = 256
) -> list[str]:
    """A tiny Llama quantized by the format's rule (all linears but lm_head); returns their names.
    Also the FP8 checkpoint of examples/finetune_fp8_checkpoint.py."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=positions, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tensors, names = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = _quantize(module.weight.detach())
            names.append(name)
    for key, value in model.state_dict().items():
        tensors.setdefault(key, value.contiguous())
    config.quantization_config = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"],
    }  # fmt: skip
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return names


def _base_bytes_per_param(model: torch.nn.Module, names: list[str]) -> float:
    params = nbytes = 0
    for name in names:
        module = model.get_base_model().get_submodule(name)  # under PEFT's wrapper
        module = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        params += module.weight.numel()
        nbytes += sum(
            t.untyped_storage().nbytes() for t in module.parameters(recurse=False) if t is not module.bias
        )
    return nbytes / params


def run(
    hidden: int = 512,
    intermediate: int = 1536,
    layers: int = 2,
    batch: int = 4,
    seq: int = 128,
    repeats: int = 10,
) -> dict:
    import peft
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import fp8train
    from fp8train.integrations.fp8_checkpoint import load_fp8_checkpoint
    from fp8train.integrations.peft_fp8 import lora_config

    logging.set_verbosity_error()
    recipe = fp8train.Float8BlockScaling()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as directory:
        names = write_checkpoint(directory, hidden, intermediate, layers)
        torch.manual_seed(0)
        ours = peft.get_peft_model(
            load_fp8_checkpoint(directory, recipe), lora_config(r=8, target_modules=targets)
        )
        torch.manual_seed(0)
        dequantized = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        theirs = peft.get_peft_model(dequantized, peft.LoraConfig(r=8, target_modules=targets))
    models = {
        "fp8train (stored FP8, block recipe)": (ours, True),
        "transformers (dequantized, fp32)": (theirs, False),
    }

    def step(model, fp8: bool):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def fn() -> None:
            with fp8train.autocast(enabled=fp8, recipe=recipe):
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return fn

    times = interleaved_times({k: step(m, fp8) for k, (m, fp8) in models.items()}, repeats, warmup_blocks=2)
    reference = quartiles(times["transformers (dequantized, fp32)"])[1]
    rows = []
    for name, (model, _) in models.items():
        q1, median, q3 = quartiles(times[name])
        rows.append({
            "path": name,
            "base bytes/param": round(_base_bytes_per_param(model, names), 4),
            "step ms (median)": round(median * 1e3, 1),
            "IQR ms": f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}",
            "time vs transformers": round(median / reference, 2),
        })  # fmt: skip
    config = {"hidden": hidden, "intermediate": intermediate, "layers": layers, "batch": batch, "seq": seq}
    return {"config": {**config, "repeats": repeats, "lora_r": 8, "targets": targets}, "rows": rows}
