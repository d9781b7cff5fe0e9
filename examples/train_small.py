"""Train a small MLP with fp8train.Linear on CPU and print loss and scales (placeholder demo)."""

import torch

import fp8train as ft


def main(steps: int = 300) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(ft.Linear(64, 256), torch.nn.GELU(), ft.Linear(256, 64))
    target = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = ft.DelayedScaling(amax_history_len=16)
    for step in range(steps):
        x = torch.randn(128, 64)
        with ft.fp8_autocast(fp8_recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, target(x).detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            s = model[0].fp8_meta["scaling_fwd"].scale
            print(f"step {step:4d} loss {loss.item():.4f} input scale {s[0]:.1f} weight scale {s[1]:.1f}")


if __name__ == "__main__":
    main()
