"""A plain torchrun FSDP2 training script that sends NVRx heartbeats, and nothing else of the
operator's: what a team brings (docs/byo.md, path 1).

It runs under `torchrun` or NVRx's `ft_launcher` as it is, and under a ResilientTrainingJob as its
`command`. Its four NVRx lines (marked `# NVRx`) are all the operator needs to watch it for hangs;
it has no checkpoints of its own, so a restart trains again from step 1.
train_fsdp2_rtj.py is the same script with the trainer's library instead: checkpoints, a resume,
a checkpoint before its pod stops, step, loss and goodput in `kubectl get rtj`.

    torchrun --nproc-per-node=2 examples/byo/train_fsdp2.py --steps 50
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # NVRx
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int, vocab: int = 256, rows: int = 4, width: int = 33) -> torch.Tensor:
    """Deterministic data: a function of (step, rank) only, so a restart sees the same batches."""
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (rows, 1), generator=generator)
    stride = torch.randint(1, 8, (rows, 1), generator=generator)
    return (start + stride * torch.arange(width)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="pace each step (demo)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = RankMonitorClient()  # NVRx
    monitor.init_workload_monitoring()  # NVRx
    for step in range(1, args.steps + 1):
        began = time.monotonic()
        tokens = batch(step, rank).to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.send_heartbeat()  # NVRx
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
