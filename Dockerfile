# syntax=docker/dockerfile:1.7
#
# Two images from one file, chosen with --target:
#
#   docker build --target operator -t <registry>/rtj-operator:0.1.0 .   # kopf operator, no torch
#   docker build --target trainer  -t <registry>/rtj-trainer:0.1.0  .   # CUDA + EFA + torch + NVRx
#
# These images are not built in CI (CI machines have no Docker engine); tests/unit/test_dockerfile.py
# checks the invariants below by parsing this file. docs/install.md, "Images", says how to build.
#
# Base images, pinned by tag (bump them on purpose; pin by digest too if your policy asks for it):
# - python:3.12.12-slim-trixie: Debian 13, CPython 3.12.12. The operator needs no CUDA.
# - nvcr.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04: CUDA 13.0 (torch's cu130 build, and
#   NVRx's CUPTI module links libcupti.so.13), on Ubuntu 24.04, i.e. glibc 2.39 and Python 3.12:
#   exactly what the only nvidia-resiliency-ext 0.7.0 wheels (cp312/cp314, manylinux_2_39) need,
#   so here plain `pip install` takes the wheel as published.
ARG PYTHON_IMAGE=python:3.12.12-slim-trixie
ARG CUDA_IMAGE=nvcr.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# requirements: the dependency pins of each image, read from pyproject.toml (their only source):
# shared [project.dependencies] plus the extra named like the image.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python - /requirements <<'PY'
"""Write <out>/operator.txt and <out>/trainer.txt from pyproject.toml in the working directory."""
import pathlib
import sys
import tomllib

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for image in ("operator", "trainer"):
    pins = [*project["dependencies"], *project["optional-dependencies"][image]]
    (out / f"{image}.txt").write_text("\n".join(pins) + "\n")
PY

# ---------------------------------------------------------------------------------------------
# operator: python -m rtj_operator. Only operator/rtj_operator and its dependencies (kopf,
# kubernetes, pydantic, prometheus-client, pyyaml); trainer/ never enters this image.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY --from=requirements /requirements/operator.txt /tmp/operator.txt
RUN /opt/venv/bin/pip install -r /tmp/operator.txt
# Copied, not pip-installed: pyproject.toml builds one distribution holding both packages.
# Only the package directory goes in, so no folder named `operator` shadows the standard library.
COPY operator/rtj_operator /opt/venv/lib/python3.12/site-packages/rtj_operator
# The wire both images speak (standard library only).
COPY wire/rtj_wire /opt/venv/lib/python3.12/site-packages/rtj_wire
RUN /opt/venv/bin/python -m compileall -q /opt/venv/lib/python3.12/site-packages/rtj_operator \
      /opt/venv/lib/python3.12/site-packages/rtj_wire \
 && /opt/venv/bin/python -c "import operator, rtj_operator, rtj_wire; operator.itemgetter"

FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="rtj-operator" \
      org.opencontainers.image.description="Kubernetes operator for ResilientTrainingJob" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 rtj \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin rtj
COPY --from=operator-build /opt/venv /opt/venv
# Bytecode is compiled at build time: the chart runs this image with a read-only root file system.
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# Liveness (/healthz) and the operator's metrics; both ports are configurable (RTJ_OPERATOR_*_PORT).
EXPOSE 8080 9090
ENTRYPOINT ["python", "-m", "rtj_operator"]

# ---------------------------------------------------------------------------------------------
# trainer: python -m rtj_trainer (the operator wraps it in ft_launcher through the pod command).
# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS trainer-build
# torch 2.13.0 built for CUDA 13.0 (the same version, cu130 build, that the CI venv runs on CPU).
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu130
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
# torch first, from PyTorch's CUDA index, so the resolve of the other pins keeps this build.
RUN /opt/venv/bin/pip install "torch==${TORCH_VERSION}" \
      --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"
COPY --from=requirements /requirements/trainer.txt /tmp/trainer.txt
# nvidia-resiliency-ext==0.7.0 comes from trainer.txt and installs with plain pip here (Python 3.12,
# glibc 2.39). The Debian 12 CI machines need a workaround instead (hack/ and pyproject.toml say
# which); that workaround must never be needed in this image.
RUN /opt/venv/bin/pip install -r /tmp/trainer.txt \
 && /opt/venv/bin/python -c "import torch; assert torch.version.cuda, 'torch is not a CUDA build'"
COPY trainer/rtj_trainer /opt/venv/lib/python3.12/site-packages/rtj_trainer
COPY wire/rtj_wire /opt/venv/lib/python3.12/site-packages/rtj_wire
RUN /opt/venv/bin/python -m compileall -q /opt/venv/lib/python3.12/site-packages/rtj_trainer \
      /opt/venv/lib/python3.12/site-packages/rtj_wire \
 && /opt/venv/bin/python -c "import rtj_trainer.launcher.shim, rtj_wire, nvidia_resiliency_ext.fault_tolerance" \
 && test -x /opt/venv/bin/ft_launcher

FROM ${CUDA_IMAGE} AS trainer
LABEL org.opencontainers.image.title="rtj-trainer" \
      org.opencontainers.image.description="FSDP trainer for ResilientTrainingJob (CUDA, EFA, NVRx)" \
      org.opencontainers.image.licenses="Apache-2.0"
# EFA userspace (libfabric with the EFA provider, rdma-core) and the aws-ofi-nccl plugin, which
# EFA installers since the 1.3x series bundle under /opt/amazon/ofi-nccl. --skip-kmod: the kernel
# module belongs to the node (the EKS GPU AMI has it); --skip-limit-conf: the memlock limit comes
# from the container runtime (unlimited on EKS nodes). The pod gets its EFA devices from the EFA
# device plugin (vpc.amazonaws.com/efa) and FI_PROVIDER/FI_EFA_USE_DEVICE_RDMA from the operator.
# Never `latest`: the plugin must match the NCCL inside torch's wheels; bump both together.
ARG EFA_INSTALLER_VERSION=1.43.2
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 ca-certificates curl \
 && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      | tar -xz -C /tmp \
 && cd /tmp/aws-efa-installer \
 && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
 && ls /opt/amazon/ofi-nccl/lib/libnccl-net*.so \
 && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*
# To build aws-ofi-nccl from source instead (a newer plugin than the installer's), configure it
# with --with-libfabric=/opt/amazon/efa --with-cuda=/usr/local/cuda --enable-platform-aws and
# install it under /opt/amazon/ofi-nccl, replacing the bundled one.
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}
RUN groupadd --gid 10001 rtj \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rtj --shell /bin/bash rtj
COPY --from=trainer-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/rtj
WORKDIR /home/rtj
# Non-root. The IPC_LOCK capability the operator adds does not reach a non-root process's effective
# set; EFA's memory registration relies on the node's unlimited memlock limit instead (the EKS AMI
# default; docs/install.md, "Locked memory").
USER 10001:10001
# The CUDA base image's entrypoint script is dropped: the operator gives the whole argv
# (ft_launcher ... -- python -m rtj_trainer) in the pod spec; this CMD is for running it by hand.
ENTRYPOINT []
CMD ["python", "-m", "rtj_trainer"]
