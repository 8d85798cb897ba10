"""`python -m rtj_trainer.export CKPT_DIR --format hf --out DIR`: a checkpoint that leaves.

Takes the newest committed checkpoint in CKPT_DIR (a job's `checkpoint.dir`; or one checkpoint's
own directory), checks every shard against its manifest, puts the model's tensors back together
from every rank's shard (rtj_trainer.checkpoint.reshard) and writes, for `--format hf`, a
Hugging Face directory: `model.safetensors` and the `config.json` the job trained with (a model
built from `model.hf_path`; the checkpoint keeps its config). `AutoModelForCausalLM.from_pretrained
(DIR)` loads it. `--dtype bfloat16` halves it (the trainer keeps fp32 master weights).

Runs on one machine with no process group and no GPU: it reads the shards from the shared store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (
    CheckpointError,
    committed_checkpoints,
    read_manifest,
    read_shard,
    shard_file_name,
    validation_problems,
)
from .checkpoint.reshard import whole
from .parallel import MODEL
from .statekeys import HF_CONFIG

FORMATS = ("hf",)


def newest_checkpoint(path: Path) -> Path:
    """`path` itself when it is one committed checkpoint, else the newest committed checkpoint
    under it that validates."""
    if (path / "manifest.json").is_file():
        return path
    rejected: list[str] = []
    for candidate in committed_checkpoints(path):
        manifest = read_manifest(candidate)
        problems = validation_problems(candidate, world_size=manifest.world_size,
                                       verify_ranks=None, verify_checksums=True)
        if not problems:
            return candidate
        rejected.extend(problems)
    raise CheckpointError(f"{path}: no committed checkpoint validates"
                          f"{': ' + '; '.join(rejected[:3]) if rejected else ''}")


def read_all_shards(checkpoint: Path) -> tuple[dict[int, dict[str, Any]], int]:
    """Every rank's state of the checkpoint (checked against the manifest), and its world size."""
    manifest = read_manifest(checkpoint)
    problems = validation_problems(checkpoint, world_size=manifest.world_size, verify_ranks=None,
                                   verify_checksums=True)
    if problems:
        raise CheckpointError(f"{checkpoint}: {'; '.join(problems)}")
    states = {rank: read_shard(checkpoint / shard_file_name(rank, manifest.world_size))
              for rank in range(manifest.world_size)}
    return states, manifest.world_size


def export_hf(checkpoint: Path, out: Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write the checkpoint's model as a Hugging Face directory; returns `out`."""
    from safetensors.torch import save_file

    states, world_size = read_all_shards(checkpoint)
    config_text = states[0].get(HF_CONFIG)
    if not config_text:
        raise CheckpointError(f"{checkpoint}: not a Hugging Face model's checkpoint (the job did "
                              "not train with model.hf_path), nothing to write as config.json")
    config = json.loads(config_text)
    tensors = whole(states, world_size=world_size, under=MODEL)
    if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
        del tensors["lm_head.weight"]  # tied to the input embeddings, as Hugging Face saves it
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: (t.to(dtype) if dtype is not None else t).contiguous()
               for name, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtj_trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path,
                        help="a job's checkpoint.dir (its newest commit) or one checkpoint")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the weights (default: as trained, float32)")
    args = parser.parse_args(argv)
    try:
        checkpoint = newest_checkpoint(args.checkpoint)
        out = export_hf(checkpoint, args.out,
                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"rtj_trainer.export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
