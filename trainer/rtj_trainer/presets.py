"""The named starting points of a run's configuration (`--preset`), from CPU tests to ~8B.

A preset is a nested dict in the shape of `rtj_trainer.config.Config`;
`rtj_trainer.configload.build_config` merges the file, environment and `--set` layers over it and
validates the result once.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: a few milliseconds per step with 2 gloo ranks.
    "tiny": {
        "model": {"num_layers": 2, "d_model": 64, "num_heads": 4, "vocab_size": 256, "seq_len": 32},
        "data": {"batch_size": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 5},
        "train": {"steps": 30, "log_every": 5},
        "checkpoint": {"interval_steps": 5, "keep": 3},
    },
    # ~125M parameters (GPT-2 small shape).
    "small": {
        "model": {"num_layers": 12, "d_model": 768, "num_heads": 12, "vocab_size": 32000,
                  "seq_len": 1024},
        "data": {"batch_size": 8},
        "train": {"steps": 1000},
        "checkpoint": {"interval_steps": 200},
    },
    # ~0.94B parameters: 16 x 2048, 32k vocabulary, 2k context.
    "1b": {
        "model": {"num_layers": 16, "d_model": 2048, "num_heads": 16, "vocab_size": 32000,
                  "seq_len": 2048},
        "data": {"batch_size": 8},
        "optim": {"lr": 3e-4, "warmup_steps": 100},
        "train": {"steps": 2000, "log_every": 10},
        "checkpoint": {"interval_steps": 100},
    },
    # ~7.5B parameters: 32 x 4096, 64k vocabulary, 4k context (needs several GPUs).
    "8b": {
        "model": {"num_layers": 32, "d_model": 4096, "num_heads": 32, "vocab_size": 65536,
                  "seq_len": 4096},
        "data": {"batch_size": 1},
        "optim": {"lr": 1.5e-4, "warmup_steps": 200},
        "train": {"steps": 2000, "log_every": 10},
        "checkpoint": {"interval_steps": 200},
    },
}

__all__ = ["PRESETS"]
