# Two commands matter: `make demo` and `make test`. Both install what they need.
# `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
CLUSTER_DIR := .cluster
PYTEST_ARGS ?=
KUEUE ?=

.PHONY: help install testbin test test-unit test-integration test-e2e test-long lint crds demo \
        cluster-up cluster-down operator-up operator-down train-local bench helm-lint images wheel

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: ## create/refresh .venv (Python 3.12, torch, kopf, NVRx 0.7.0); idempotent
	@python3 hack/install.py

testbin: ## build etcd/kube-apiserver/controller-manager/scheduler and Kueue, fetch kubectl+helm (cached in ~/.cache)
	@bash hack/build-testbin.sh >/dev/null
	@bash hack/build-kueue.sh >/dev/null

test: install testbin ## lint (ruff, mypy --strict, import contracts) + unit, integration and e2e tiers (not the long drills)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not long and not gpu" $(PYTEST_ARGS)

test-long: install testbin ## the long failure drills (partition, hung node, never-starting pod, ...): ~15-30 min
	$(PY) -m pytest -m long $(PYTEST_ARGS)

test-gpu: ## the gpu tier (needs CUDA and Triton: a device machine, not CI)
	$(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

test-unit: install ## unit tier only (no cluster)
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-integration: install testbin ## integration tier only (real kube-apiserver)
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

test-e2e: install testbin ## end-to-end tier only (control plane + process-backed nodes + trainer)
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

lint: install ## ruff, mypy (strict) and the import-linter contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

crds: install ## regenerate crds/ and the chart's CRD from the pydantic models
	$(PY) -m rtj_operator.api.crd --write

demo: install testbin ## local control plane + operator + a small CPU job with an injected fault
	$(PY) hack/demo.py

cluster-up: install testbin ## start a local cluster in the background (KUEUE=1: with real Kueue); then: . .cluster/env
	PYTHONPATH=tests $(PY) -m harness up --dir $(CLUSTER_DIR) $(if $(KUEUE),--kueue)

cluster-down: ## stop the local cluster (and the operator) started by cluster-up
	-@bash hack/operator-down.sh $(CLUSTER_DIR)
	PYTHONPATH=tests $(PY) -m harness down --dir $(CLUSTER_DIR)

operator-up: install ## run the operator in the background against the cluster of cluster-up
	bash hack/operator-up.sh $(CLUSTER_DIR)

operator-down: ## stop the operator started by operator-up
	bash hack/operator-down.sh $(CLUSTER_DIR)

train-local: install ## tiny CPU trainer, 2 ranks under ft_launcher, no Kubernetes (honours TRAINER_FAULTS)
	bash trainer/scripts/train-local.sh

helm-lint: testbin ## lint the Helm chart with default values and with every optional part on
	$$(bash hack/build-testbin.sh)/helm lint --strict charts/rtj-operator
	$$(bash hack/build-testbin.sh)/helm lint --strict charts/rtj-operator --set rbac.clusterScoped=false,metrics.serviceMonitor.enabled=true

wheel: install ## dist/*.whl: the trainer package (rtj_trainer, rtj_trainer.lib, rtj_wire) for a team's own image (docs/byo.md)
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

images: ## build both images (needs Docker with BuildKit; not run in CI: no Docker engine here)
	docker buildx build --target operator -t rtj-operator:0.1.0 .
	docker buildx build --target trainer  -t rtj-trainer:0.1.0 .

bench: install ## CPU benchmarks (see docs/benchmarks.md)
	$(PY) -m bench
