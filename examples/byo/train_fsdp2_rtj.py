"""train_fsdp2.py with the trainer's library (docs/byo.md, path 2): the lines marked `# rtj` replace
its four NVRx lines and its loop header (which starts after the resumed step). The library sends the
NVRx heartbeats, checkpoints the model and the optimizer (async, committed atomically), resumes from
the newest commit after any restart, commits a checkpoint of the current step before its pod stops,
and reports step, loss and goodput to the operator (`kubectl get rtj`).
tests/unit/test_byo_examples.py counts the lines it adds.

    ft_launcher --nproc-per-node=2 examples/byo/train_fsdp2_rtj.py --steps 50
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from rtj_trainer import lib as rtj  # rtj
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
    run = rtj.init({"model": model, "optimizer": optimizer})  # rtj
    for step in range(run.start_step + 1, args.steps + 1):  # rtj
        began = time.monotonic()
        tokens = batch(step, rank).to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if run.step(step, loss):  # rtj
            break  # rtj
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    run.finish()  # rtj
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
