"""Where a warm worker's start goes on a GPU machine: what the cold start waits for before the
worker attaches (rtj_trainer.warm.worker: its imports, the model's preloads, the device warm-up).
Run it twice in a row: the first on a fresh machine reads everything from disk, the second finds
the page cache (and Triton's disk cache) warm.

    python3 bench/device/warmstart.py --hf-path bench/models/llama-1b > $OUT/warmstart-1.json

One JSON object: seconds per import (in the warm worker's order: PRELOADED, then the model's
preloads as warmwire.model_preloads names them) and the device warm-up's report (its parts:
context, matmul_bfloat16, matmul_float32, triton).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

started = time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", default="", help="the model directory of the run")
    parser.add_argument("--local-rank", type=int, default=0)
    args = parser.parse_args()
    from rtj_trainer.warm import device, worker
    from rtj_trainer.warm import wire as warmwire

    out: dict[str, object] = {"interpreter_to_main": round(time.perf_counter() - started, 3)}
    imports: dict[str, float] = {}
    preloads = warmwire.model_preloads(["--set", f"model.hf_path={args.hf_path}"]
                                       if args.hf_path else [])
    for name in [*worker.PRELOADED, *preloads]:
        began = time.perf_counter()
        importlib.import_module(name)
        imports[name] = round(time.perf_counter() - began, 3)
    out["imports"] = imports
    out["imports_total"] = round(sum(imports.values()), 3)
    began = time.perf_counter()
    out["device_warm_up"] = device.warm_up(args.local_rank)
    out["device_warm_up_total"] = round(time.perf_counter() - began, 3)
    out["total"] = round(time.perf_counter() - started, 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
