"""A small training script written against MindTorch v2's public API only:
Linear-ReLU-Linear, MSE loss, backward, SGD. `python train_mlp.py [npu|cpu]
[steps]` prints one JSON line per step: {"step": i, "loss": float}.
Nothing in it knows about npualloc or the simulator."""
import json
import sys

import mindtorch_v2 as torch
import mindtorch_v2.nn as nn
import mindtorch_v2.nn.functional as F
import mindtorch_v2.optim as optim


def train(device="npu", steps=5, on_step=None):
    torch.manual_seed(0)
    inputs, targets = torch.randn(64, 32), torch.randn(64, 8)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8)).to(device)
    inputs, targets = inputs.to(device), targets.to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.to("cpu").item()))
        if on_step is not None:
            on_step(step, losses[-1])
    return model, losses


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "npu"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    train(device, steps, on_step=lambda step, loss: print(json.dumps({"step": step, "loss": loss}), flush=True))
