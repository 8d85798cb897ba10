#!/usr/bin/env bash
# Source this on a GPU machine lent to us (no network there) before running a
# benchmark from the repository root:
#
#   . bench/device/setup.sh            # wheels carried in .whl/ (see docs/benchmarks.md)
#
# It installs the carried wheels into /tmp/site: nvidia-resiliency-ext 0.7.0 plus what its
# launcher and in-process modules import that the 'cuda' image lacks (pydantic 2.14.4,
# pydantic-core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5, defusedxml 0.7.1,
# grpcio 1.85.3, grpcio-tools 1.85.1, protobuf 7.36.2), and makes a
# two-file "venv" (bin/python, bin/ft_launcher) that trainer/scripts/train-local.sh can use as
# RTJ_VENV (the image's python3 is itself a virtualenv, so `python -m venv
# --system-site-packages` would not see its torch), and grows /dev/shm, where the checkpoint
# staging buffers live.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/trainer:$PWD/operator:$PWD/wire:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/rtj-venv/bin
cat > /tmp/rtj-venv/bin/python <<PY
#!/usr/bin/env bash
exec python3 "\$@"
PY
cat > /tmp/rtj-venv/bin/ft_launcher <<PY
#!/usr/bin/env bash
exec python3 -c 'import sys; from nvidia_resiliency_ext.fault_tolerance.launcher import main; sys.argv[0] = "ft_launcher"; sys.exit(main())' "\$@"
PY
chmod +x /tmp/rtj-venv/bin/*
export RTJ_VENV=/tmp/rtj-venv
mount -o remount,size=100G /dev/shm 2>/dev/null || true
python3 -c 'import torch, pydantic
import nvidia_resiliency_ext.fault_tolerance.launcher, nvidia_resiliency_ext.inprocess
import rtj_trainer.train
print("[device] torch", torch.__version__, "gpus", torch.cuda.device_count())
# The warm worker imports took 12-16 s here against ~4 s on the CI machine (docs/benchmarks.md,
# nineteenth session): whether the image ships bytecode for torch, and may write it, is the first
# thing to rule out (our own trainer image compiles it at build time).
import os, sys, importlib.util
tag, package = sys.implementation.cache_tag, os.path.dirname(torch.__file__)
cache = os.path.join(package, "__pycache__")
pycs = [n for n in os.listdir(cache) if tag in n] if os.path.isdir(cache) else []
dynamo = importlib.util.cache_from_source(os.path.join(package, "_dynamo", "__init__.py"))
print("[device] bytecode: dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix",
      sys.pycache_prefix, "torch/__pycache__", len(pycs), tag, "files; writable",
      os.access(package, os.W_OK), "torch._dynamo cached", os.path.exists(dynamo))' || return 1
