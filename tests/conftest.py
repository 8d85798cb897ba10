"""Shared pytest fixtures: one local cluster per session, a fresh namespace per test.

The cluster (real etcd, kube-apiserver, kube-controller-manager, kube-scheduler and three
process-backed p5.48xlarge nodes, see `harness`) starts lazily, the first time a test asks for
it, and is always torn down at the end of the session. Missing control-plane binaries are built
first by hack/build-testbin.sh (a cold build takes a long time; its progress is shown).

Real Kueue (the `kueue` fixture, harness.kueue) starts only when a test asks for it, once per
session, in that cluster; hack/build-kueue.sh builds it first when its cache is cold.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from harness.cluster import Cluster
from harness.kueue import Kueue


@pytest.fixture(scope="session")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("cluster")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    started = time.monotonic()
    with capture.global_and_fixture_disabled():  # show build progress and the start time
        instance = Cluster.start(run_dir)
        print(f"\n[harness] cluster ready in {time.monotonic() - started:.1f} s ({run_dir})")
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="session")
def kueue(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Kueue]:
    """Kueue's controller manager and CRDs in the session's cluster (stopped before it)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    started = time.monotonic()
    with capture.global_and_fixture_disabled():
        instance = Kueue.start(cluster)
        print(f"\n[harness] kueue ready in {time.monotonic() - started:.1f} s")
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test; its deletion is started afterwards, not awaited."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    name = cluster.create_namespace(prefix or "test")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)
