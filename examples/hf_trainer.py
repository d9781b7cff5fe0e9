"""Train a tiny Llama with the Hugging Face Trainer in FP8: one added line, `fp8train.prepare(model)`.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py       # 2 CPU ranks (gloo), DDP
    python examples/hf_trainer.py --steps 20 --no-fp8                     # one process, no FP8

Nothing is downloaded: the model is built from a LlamaConfig (hidden 64, 2 layers, vocab 256) and
trained on the bytes of the Python standard library's own source. Needs `pip install "fp8train[hf]"`.
Prints the loss and, at the end, the amax collectives per optimizer step (2 per microbatch).
"""

from __future__ import annotations

import argparse
import os
import sysconfig

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import fp8train

SEQ = 64


class StdlibBytes(torch.utils.data.Dataset):
    """Fixed windows of the standard library's .py files, byte-level (tokens 0..255)."""

    def __init__(self, n: int, seed: int) -> None:
        root, data = sysconfig.get_paths()["stdlib"], bytearray()
        for name in sorted(os.listdir(root)):
            if name.endswith(".py") and len(data) < 1_000_000:
                with open(os.path.join(root, name), "rb") as f:
                    data += f.read()
        text = torch.frombuffer(data, dtype=torch.uint8).long()
        starts = torch.randint(0, len(text) - SEQ, (n,), generator=torch.Generator().manual_seed(seed))
        self.windows = text[starts[:, None] + torch.arange(SEQ)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class AmaxCollectives(TrainerCallback):
    """fp8train's amax reductions launched per optimizer step (its own counter)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.last = 0

    def on_step_end(self, args, state, control, **kwargs):
        launched = fp8train.inspection.counters()["launched"]
        self.per_step.append(launched - self.last)
        self.last = launched


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--batch", type=int, default=8, help="per-device microbatch size")
    parser.add_argument("--no-fp8", action="store_true", help="train without fp8train (the reference)")
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not args.no_fp8:
        model = fp8train.prepare(model)  # the one line: every call of the model is one FP8 region

    world = int(os.environ.get("WORLD_SIZE", "1"))
    counter = AmaxCollectives()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        max_steps=args.steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        report_to=[],
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        disable_tqdm=True,
    )
    train = StdlibBytes(args.steps * args.accum * args.batch * world, seed=0)
    trainer = Trainer(model=model, args=training_args, train_dataset=train, callbacks=[counter])
    trainer.train()
    evaluation = trainer.evaluate(StdlibBytes(64, seed=1))
    if trainer.is_world_process_zero():
        print(f"final eval loss {evaluation['eval_loss']:.4f} ({'no FP8' if args.no_fp8 else 'FP8'})")
        if not args.no_fp8 and world > 1:  # a single process reduces nothing
            print(f"amax collectives per optimizer step: {sorted(set(counter.per_step))}")
    trainer.save_model(os.path.join(args.output_dir, "final"))  # FP8 state included (safetensors)


if __name__ == "__main__":
    main()
