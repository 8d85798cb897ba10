"""Where a training step's GPU time goes, the GPT against the Hugging Face Llama of the same
size (bench/models/llama-1b), one GPU, the `1b` shape at batch 8: five warm-up steps, then five
profiled; prints the 25 CUDA kernels with the most time for each model and the step time.

    python3 bench/device/profile_step.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from rtj_trainer import parallel
from rtj_trainer.configload import build_config
from rtj_trainer.data import TokenBatches
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile


def profile_model(name: str, sets: list[str], ctx: parallel.DistributedContext) -> None:
    cfg = build_config(preset="1b", env={}, overrides=["train.device=cuda", *sets])
    model = parallel.build_model(cfg, ctx)
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                        world_size=1)

    def step(i: int) -> None:
        batch = data.batch(i, 0).to(ctx.device)
        parallel.train_step(model, optimizer, scheduler, batch, cfg.optim.grad_clip).item()

    for i in range(1, 6):
        step(i)
    torch.cuda.synchronize()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(6, 11):
            step(i)
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - began) / 5
    print(f"=== {name}: {seconds * 1000:.1f} ms/step (profiled)", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                    max_name_column_width=70), flush=True)


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    ctx = parallel.DistributedContext(rank=0, local_rank=0, world_size=1, device=device,
                                      mesh=init_device_mesh("cuda", (1,)))
    for name, sets in [("gpt", []),
                       ("hf", [f"model.hf_path={os.getcwd()}/bench/models/llama-1b"])]:
        profile_model(name, sets, ctx)
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
