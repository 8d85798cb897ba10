"""The contracts between the operator and the trainer, tied together at the unit tier.

Both sides spell the wire with one package, rtj_wire (env names, ports and exit codes, the
`/ranks` document, the termination message, the lost-pods verdict). These tests feed one side's
real output into the other side's real input, so a renamed variable or metric fails here rather
than only in e2e, and check that neither side spells a wire name by hand:

- the environment: `trainerenv.trainer_env` writes the `RTJ_*` variables, and
  `rtj_trainer.configload.build_config(env=...)` reads them (docs/design.md);
- the metrics: `rtj_trainer.metrics.TrainerMetrics` renders a rank's Prometheus page, the launcher
  shim turns it into the `/ranks` document, and `rtj_operator.scraping` reads both back;
- the lost-pods verdict and the termination message, end to end through both sides.

Tests may import both packages; import-linter keeps the packages themselves apart.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from rtj_operator import builders, trainerenv
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for
from rtj_operator.scraping import rank_sample_from_text
from rtj_trainer.configload import build_config
from rtj_trainer.metrics import Snapshot, TrainerMetrics

pytestmark = pytest.mark.unit

SETTINGS = OperatorSettings(trainer_metrics_port=9500)
POD_FIELDS = {"status.podIP": "10.1.2.3", "metadata.name": "llama-1", "metadata.namespace": "ml",
              "metadata.uid": "pod-uid-1"}
"""What the kubelet puts into the downward-API variables."""


def spec_job(**spec: Any) -> Any:
    return parse_job({
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-7", "generation": 1},
        "spec": {
            "nodes": 3,
            "image": "trainer:1",
            "instanceType": "c7i.8xlarge",
            "procsPerNode": 2,
            "resources": {"requests": {"cpu": "4"}},
            "checkpoint": {"claimName": "fsx", "mountPath": "/ckpt", "intervalSteps": 250,
                           "keep": 4, "mode": "Sync"},
            "faultTolerance": {"heartbeatTimeoutSeconds": 45,
                               "initialHeartbeatTimeoutSeconds": 300,
                               "inProcessRestart": "Disabled"},
            **spec,
        },
    })


def kubelet_env(env: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the process sees it (fieldRefs resolved)."""
    resolved: dict[str, str] = {}
    for entry in env:
        if "value" in entry:
            resolved[entry["name"]] = entry["value"]
        else:
            resolved[entry["name"]] = POD_FIELDS[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return resolved


def test_the_trainer_reads_the_spec_from_the_environment_the_operator_writes() -> None:
    job = spec_job()
    env = trainerenv.trainer_env(job, plan=plan_for(job, SETTINGS), node_index=1, attempt=2,
                               settings=SETTINGS)
    config = build_config(preset="tiny", env=kubelet_env(env))

    cp = config.checkpoint
    assert (cp.dir, cp.interval_steps, cp.keep, cp.mode) == (job.checkpoint_dir, 250, 4, "sync")
    assert cp.dir.startswith("/ckpt/")
    assert config.resiliency.heartbeat_timeout_seconds == 45
    assert config.resiliency.inprocess_restart is False
    assert (config.metrics.host, config.metrics.port) == ("10.1.2.3", 9500)
    identity = config.job
    assert (identity.name, identity.uid, identity.namespace, identity.pod_name) == (
        "llama", "uid-7", "ml", "llama-1")
    assert (identity.node_index, identity.nnodes, identity.procs_per_node, identity.attempt) == (
        1, 3, 2, 2)
    assert identity.pod_uid == "pod-uid-1"  # what the operator names when the pod is lost


def test_in_process_restart_enabled_in_the_spec_is_enabled_in_the_trainer() -> None:
    job = spec_job(faultTolerance={"inProcessRestart": "Enabled"})
    env = trainerenv.trainer_env(job, plan=plan_for(job, SETTINGS), node_index=0, attempt=0,
                               settings=SETTINGS)
    assert build_config(preset="tiny", env=kubelet_env(env)).resiliency.inprocess_restart is True


def test_the_operator_reads_back_what_a_trainer_rank_serves() -> None:
    metrics = TrainerMetrics(rank=5, local_rank=1, job="llama", attempt=2)
    snapshot = Snapshot(
        heartbeat_timestamp=1_700_000_123.5,
        step=420,
        checkpoint_committed_step=400,
        checkpoint_committed_timestamp=1_700_000_100.25,
        restarts={"inprocess": 3, "launcher": 1, "pod": 2},
        job_started_at=time.time() - 1000.0,
        productive_seconds=500.0,
    )
    metrics.watch(lambda: snapshot)

    sample = rank_sample_from_text(generate_latest(metrics.registry).decode(), local_rank=1)

    assert (sample.local_rank, sample.rank) == (1, 5)
    assert sample.heartbeat == 1_700_000_123.5
    assert (sample.step, sample.committed_step) == (420, 400)
    assert sample.committed_time == 1_700_000_100.25
    assert sample.restarts == {"inprocess": 3, "launcher": 1, "pod": 2}
    assert sample.goodput_ratio == pytest.approx(0.5, abs=0.01)


def test_a_fresh_trainer_rank_reads_as_no_heartbeat_and_no_checkpoint_yet() -> None:
    metrics = TrainerMetrics(rank=0, local_rank=0, job="llama", attempt=0)
    sample = rank_sample_from_text(generate_latest(metrics.registry).decode(), local_rank=0)
    assert (sample.rank, sample.step) == (0, 0)
    assert sample.heartbeat is None
    assert sample.committed_step is None and sample.committed_time is None


# --- a lost pod announced ------------------------------------------------------------------------


def test_the_trainers_endpoint_takes_the_operators_announcement_of_a_lost_pod(
    tmp_path: Path,
) -> None:
    """The operator's `Scraper.announce` posts to a trainer pod's real endpoint (the launcher
    shim's `podmetrics.serve` with its verdict book); the verdict lands in the file the workers
    read, on the port the pod builder gives the trainer."""
    from rtj_operator.decisions import podloss as announcing
    from rtj_operator.observed import PodView
    from rtj_operator.scraping import Scraper
    from rtj_trainer import podloss
    from rtj_trainer.launcher import podmetrics, verdicts
    from rtj_wire.lostpods import LostPod

    book = verdicts.VerdictBook(tmp_path / "lost.json", own_uid="uid-0")
    ranks = podmetrics.PodRanks(host="127.0.0.1", metrics_port=1, procs=1, fetch=lambda _: None)
    server = podmetrics.serve(ranks, "127.0.0.1", 0, book)
    port = server.server_address[1]
    base_port = port + 1  # the endpoint is one below the ranks' base port on both sides
    assert podmetrics.pod_port(base_port) == port
    lost = PodView(name="llama-1", uid="uid-1", role="trainer", node_index=1, phase="Failed")
    peer = PodView(name="llama-0", uid="uid-0", role="trainer", node_index=0, phase="Running",
                   pod_ip="127.0.0.1")
    verdict = announcing.announcement(lost, in_process_restart=True, peers=[lost, peer],
                                      already_announced=False, spares=1)
    assert verdict is not None

    async def announce() -> int:
        scraper = Scraper(concurrency=4, timeout_seconds=5)
        try:
            return await scraper.announce(verdict, base_port=base_port)
        finally:
            await scraper.close()

    try:
        assert asyncio.run(announce()) == 1
    finally:
        threading.Thread(target=server.shutdown).start()
        server.server_close()
    assert podloss.read_verdicts(book.path) == [LostPod("uid-1", "llama-1", "PodFailed")]


def test_the_lost_pods_file_the_shim_exports_is_what_the_worker_reads(tmp_path: Path) -> None:
    from rtj_trainer.launcher import shim

    env = {"POD_UID": "pod-uid-1"}
    book = shim.verdict_book(env)
    assert book.own_uid == "pod-uid-1"
    config = build_config(preset="tiny", env=env)
    assert config.resiliency.lost_pods_file == str(book.path)
    assert config.job.pod_uid == "pod-uid-1"


# --- the termination message --------------------------------------------------------------------


def test_the_operator_reads_every_termination_message_the_trainer_writes() -> None:
    from rtj_trainer import termination as writer
    from rtj_wire import termination as reader

    for message in (
        writer.TerminationMessage(outcome=writer.SUCCEEDED, step=80, committed_step=80,
                                  committed_time=1764417600.25, reason="Completed",
                                  message="training reached step 80", exit_code=0),
        writer.TerminationMessage(outcome=writer.FAILED, reason="WorldSizeChanged",
                                  message="x" * 9000, exit_code=94),
        writer.TerminationMessage(outcome=writer.STOPPED, step=37, committed_step=37,
                                  committed_time=1764417601.5,
                                  checkpoint="/checkpoints/team/job/step-000000037.a0-l0-i0-1",
                                  reason="CheckpointedBeforeStop",
                                  message="checkpointed step 37 before stopping", exit_code=0),
    ):
        outcome, problem = reader.parse(message.encode().decode())
        assert problem is None and outcome is not None
        assert outcome.outcome == message.outcome and outcome.step == message.step
        assert outcome.committed_step == message.committed_step
        assert outcome.committed_time == message.committed_time
        assert outcome.checkpoint == message.checkpoint
        assert outcome.reason == message.reason and outcome.exit_code == message.exit_code
        assert message.message.startswith(outcome.message.removesuffix("..."))
        assert outcome.stopped == (message.outcome == writer.STOPPED)


def test_the_path_and_the_fatal_exit_code_agree_on_both_sides() -> None:
    from rtj_operator import launcher
    from rtj_trainer import errors, termination
    from rtj_trainer.config import ConfigError

    j = spec_job()
    pod = builders.trainer_pod(j, plan=plan_for(j, SETTINGS), node_index=0, attempt=0,
                               settings=SETTINGS)
    container = pod["spec"]["containers"][0]
    env = kubelet_env(container["env"])
    assert env[termination.PATH_ENV] == container["terminationMessagePath"]
    assert str(termination.configured_path(env)) == container["terminationMessagePath"]
    assert launcher.TRAINER_FATAL_EXIT_CODE == errors.FATAL_EXIT_CODE
    assert f"--rtj-non-retryable-exit-codes={errors.FATAL_EXIT_CODE}" in container["command"]
    assert issubclass(ConfigError, errors.FatalError)


# --- one spelling of the wire -------------------------------------------------------------------


def test_every_variable_the_operator_sets_for_the_trainer_is_named_in_the_wire() -> None:
    """Every `RTJ_*` variable of a trainer pod is a name of rtj_wire.env, and the trainer's
    configuration reads each one it maps (none spelled by hand on either side)."""
    from rtj_trainer import configload as trainer_config
    from rtj_wire import env as wire_env

    names = {value for key, value in vars(wire_env).items() if key.isupper()}
    j = spec_job(faultTolerance={"faultInjection": "Enabled", "spares": 1,
                                 "inProcessRestart": "Enabled"},
                 checkpoint={"claimName": "fsx", "mountPath": "/ckpt",
                             "resumeFromJobs": ["ml/old"]})
    pod = builders.trainer_pod(j, plan=plan_for(j, SETTINGS), node_index=0, attempt=0,
                               settings=SETTINGS)
    set_by_operator = {e["name"] for e in pod["spec"]["containers"][0]["env"]
                       if e["name"].startswith(("RTJ_", "POD_"))}
    assert set_by_operator <= names, set_by_operator - names
    read_by_trainer = set(trainer_config.OPERATOR_ENV)
    assert read_by_trainer <= names | {"TRAINER_FAULTS"}, read_by_trainer - names


def test_no_module_of_either_side_spells_a_wire_name_by_hand() -> None:
    """The wire's variable names, paths and metric names appear as string literals only in
    rtj_wire (and in docstrings and comments, which this does not read)."""
    import ast

    import rtj_operator
    import rtj_trainer
    from rtj_wire import env as wire_env
    from rtj_wire import lostpods, ranks

    wire_strings = {value for key, value in vars(wire_env).items()
                    if key.isupper() and value.startswith("RTJ_")}
    wire_strings |= {ranks.PATH, lostpods.PATH}
    found = []
    for package in (rtj_operator, rtj_trainer):
        root = Path(package.__file__).parent
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef |
                                        ast.AsyncFunctionDef)
                          and node.body and isinstance(node.body[0], ast.Expr)
                          and isinstance(node.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and id(node) not in docstrings and node.value in wire_strings):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.value}")
    assert found == []
