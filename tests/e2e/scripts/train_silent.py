"""A training script that reports nothing: no NVRx heartbeats, no metrics page, only gloo
collectives and a pace. What a team's script can be on its first day; the operator must watch it
as processes only (tests/e2e/test_operator_byo.py)."""

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    value = torch.ones(4)
    for step in range(1, args.steps + 1):
        dist.all_reduce(value)
        value /= dist.get_world_size()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}", flush=True)
        time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
