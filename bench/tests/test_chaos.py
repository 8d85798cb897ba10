"""The fault campaign's plan and its per-fault analysis (pure parts of bench.chaos: chaos_plan,
chaos_results, and chaos_campaign's job manifest)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
from rtj_trainer.checkpoint.format import Manifest, checkpoint_dir_name

from bench.chaos_campaign import job_manifest
from bench.chaos_faults import control_plane_outcome, parse_proc_net_tcp
from bench.chaos_plan import (
    CHECKPOINT_KINDS,
    CONTROL_PLANE_KINDS,
    HOLDING_KINDS,
    KINDS,
    JobPlan,
    PlannedFault,
    checkpoint_step,
    plan_campaign,
    plan_faults,
    replay_plans,
    still_to_run,
)
from bench.chaos_results import (
    FaultResult,
    analyse_fault,
    campaign_summary,
    final_loss,
    newest_checkpoint_dir,
    passed,
    read_campaign,
    read_commits,
    render,
    summarise,
)
from bench.localrun import StepRecord

pytestmark = pytest.mark.unit

PROCESS_KINDS = [k for k in KINDS if k not in (*CHECKPOINT_KINDS, *CONTROL_PLANE_KINDS)]
"""The first campaign's eight kinds: any step, any place in a job."""


def test_plan_has_every_kind_the_asked_number_of_times_spaced_in_each_job() -> None:
    assert len(PROCESS_KINDS) == 8
    plans = plan_campaign(PROCESS_KINDS, per_kind=5, faults_per_job=4, spacing=25, seed=3)
    kinds = Counter(f.kind for plan in plans for f in plan.faults)
    assert kinds == dict.fromkeys(PROCESS_KINDS, 5)
    assert len(plans) == 10  # 40 faults, 4 a job
    for plan in plans:
        assert [f.step for f in plan.faults] == [25 * (i + 1) for i in range(len(plan.faults))]
        assert plan.steps == 25 * (len(plan.faults) + 1)
        assert all(0 <= f.rank < 4 for f in plan.faults)
        assert plan.step_seconds() == 0.0
    assert len({plan.name for plan in plans}) == len(plans)
    assert plans == plan_campaign(PROCESS_KINDS, per_kind=5, faults_per_job=4, spacing=25,
                                  seed=3, interval=10)


def test_a_checkpoint_fault_is_planned_on_the_checkpoint_step_nearest_its_slot() -> None:
    assert checkpoint_step(25, 10, last=75) == 30  # a tie goes up
    assert checkpoint_step(50, 10, last=75) == 50
    assert checkpoint_step(24, 10, last=75) == 20
    assert checkpoint_step(3, 10, last=75) == 10  # never step 0
    assert checkpoint_step(75, 10, last=80) == 70  # never the last step's save
    assert checkpoint_step(150, 10, last=175) == 150
    with pytest.raises(ValueError, match="no checkpoint step before its last"):
        checkpoint_step(5, 10, last=10)


def test_storage_and_control_plane_kinds_are_planned_where_they_can_bite() -> None:
    kinds = list(KINDS)
    plans = plan_campaign(kinds, per_kind=6, faults_per_job=6, spacing=25, seed=5, interval=10)
    assert Counter(f.kind for plan in plans for f in plan.faults) == dict.fromkeys(KINDS, 6)
    for plan in plans:
        for i, fault in enumerate(plan.faults):
            if fault.kind in CHECKPOINT_KINDS:
                assert fault.step % 10 == 0 and 0 < fault.step < plan.steps
                assert abs(fault.step - 25 * (i + 1)) <= 5
            else:
                assert fault.step == 25 * (i + 1)
        holding = [i for i, f in enumerate(plan.faults) if f.kind in HOLDING_KINDS]
        assert holding in ([], [len(plan.faults) - 1])  # one a job, its last fault
        assert len({f.step for f in plan.faults}) == len(plan.faults)
    alone = [plan for plan in plans if any(f.kind in CONTROL_PLANE_KINDS for f in plan.faults)]
    assert len(alone) == 6 * len(CONTROL_PLANE_KINDS)
    assert plans[-len(alone):] == alone  # after the packed jobs
    for plan in alone:
        assert len(plan.faults) == 1 and plan.faults[0].step == 25 and plan.steps == 50
        assert plan.step_seconds() == 2.0
    write = JobPlan("j", 75, (PlannedFault("write-error", 30, 1), PlannedFault("pod-kill", 50, 0),
                              PlannedFault("write-lost", 50, 3)))
    assert write.trainer_faults() == "30:1:write-error,50:3:write-lost"


def test_checkpoint_faults_need_the_interval_and_distinct_steps() -> None:
    with pytest.raises(ValueError, match="need the checkpoint interval"):
        plan_faults({"write-error": 1}, 4, 25, 0)
    with pytest.raises(ValueError, match="two faults of one job on step 10"):
        plan_faults({"write-error": 2}, 2, 4, 0, interval=10)


def test_campaign_jobs_get_a_short_commit_deadline_and_control_plane_jobs_a_pace() -> None:
    plain = job_manifest(JobPlan("chaos-1", 50, (PlannedFault("write-lost", 30, 2),)), 10,
                         commit_timeout=20)
    args = plain["spec"]["args"]
    assert args[-2:] == ["--set", "checkpoint.commit_timeout_seconds=20"]
    assert not any(a.startswith("train.min_step_seconds") for a in args)
    assert {"name": "TRAINER_FAULTS", "value": "30:2:write-lost"} in plain["spec"]["env"]
    paced = job_manifest(JobPlan("chaos-2", 50, (PlannedFault("apiserver-stop", 25, 0),)), 10)
    assert "train.min_step_seconds=2" in paced["spec"]["args"]
    assert all(e["name"] != "TRAINER_FAULTS" for e in paced["spec"].get("env", []))


def test_plan_refuses_unknown_kinds_and_empty_campaigns() -> None:
    with pytest.raises(ValueError, match="unknown fault kinds: meteor"):
        plan_campaign(["exception", "meteor"], 1, 1, 10, 0)
    with pytest.raises(ValueError, match="per_kind >= 1"):
        plan_campaign(["exception"], 0, 1, 10, 0)


def test_only_trainer_faults_go_to_trainer_faults_and_the_manifest_arms_them() -> None:
    plan = JobPlan("chaos-7", 75, (PlannedFault("exception", 25, 2),
                                   PlannedFault("pod-kill", 50, 0)))
    assert plan.trainer_faults() == "25:2:exception"
    manifest = job_manifest(plan, interval=10)
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == "chaos-7"
    assert "train.steps=75" in spec["args"]
    assert {"name": "TRAINER_FAULTS", "value": "25:2:exception"} in spec["env"]
    assert spec["faultTolerance"]["faultInjection"] == "Enabled"
    assert spec["checkpoint"]["intervalSteps"] == 10
    quiet = job_manifest(JobPlan("chaos-8", 50, (PlannedFault("pod-kill", 25, 0),)), 10)
    assert all(e["name"] != "TRAINER_FAULTS" for e in quiet["spec"].get("env", []))


def _records(*rows: tuple[int, str, float]) -> list[StepRecord]:
    return [StepRecord(step, attempt, at, 1.0 / step) for step, attempt, at in rows]


def test_a_fault_resumed_from_the_newest_commit_loses_nothing_beyond_it() -> None:
    records = _records((24, "a", 100.0), (25, "a", 101.0), (21, "b", 112.5), (22, "b", 113.0))
    result = analyse_fault(FaultResult("j", "pod-kill", 25, 1, injected_at=101.5), records,
                           commits={10: 50.0, 20: 95.0, 30: 200.0})
    assert result.recovered
    assert result.seconds == 11.0
    assert result.resumed_step == 20
    assert result.committed_at_fault == 20
    assert result.steps_lost_beyond_commit == 0


def test_resuming_from_an_older_checkpoint_counts_the_steps_lost_beyond_the_commit() -> None:
    records = _records((25, "a", 101.0), (11, "b", 130.0))
    result = analyse_fault(FaultResult("j", "writer-kill", 25, 0, injected_at=101.5), records,
                           commits={10: 50.0, 20: 95.0})
    assert result.resumed_step == 10
    assert result.steps_lost_beyond_commit == 10


def test_no_step_after_the_fault_is_not_recovered() -> None:
    records = _records((25, "a", 101.0))
    result = analyse_fault(FaultResult("j", "hang", 25, 0, injected_at=101.5), records, {})
    assert not result.recovered
    assert result.seconds is None
    assert result.committed_at_fault == -1


def test_a_step_of_the_attempt_running_at_the_fault_is_not_a_recovery() -> None:
    records = _records((25, "a", 101.0), (26, "a", 101.6))
    result = analyse_fault(FaultResult("j", "rendezvous-kill", 25, 0, injected_at=101.5),
                           records, {20: 95.0})
    assert not result.recovered
    ended = FaultResult("j", "writer-kill", 25, 0, injected_at=101.5,
                        detail={"job_ended": True})
    analyse_fault(ended, records, {20: 95.0})
    assert ended.recovered and ended.detail["absorbed"] and ended.seconds is None
    assert ended.steps_lost_beyond_commit == 0


def test_final_loss_is_the_last_attempts_and_the_summary_counts_per_kind() -> None:
    records = [StepRecord(50, "a", 10.0, 2.5), StepRecord(50, "b", 20.0, 2.25)]
    assert final_loss(records, 50) == 2.25
    assert final_loss(records, 60) is None
    faults = [FaultResult("j", "hang", 25, 0, recovered=True, seconds=12.0,
                          steps_lost_beyond_commit=0),
              FaultResult("j", "hang", 50, 1, recovered=False)]
    summary = summarise(faults, [{"final_state": "Succeeded", "final_loss_identical": True}])
    assert summary["by_kind"]["hang"]["faults"] == 2
    assert summary["by_kind"]["hang"]["recovered"] == 1
    assert summary["recovered"] == 1
    assert summary["jobs_succeeded"] == summary["jobs_final_loss_identical"] == 1


def _commit(root: Path, step: int, identity: str, at: float) -> Path:
    """A checkpoint directory and manifest as the trainer writes them (its own name and format
    functions), with no shards."""
    directory = root / checkpoint_dir_name(step, identity)
    directory.mkdir(parents=True)
    manifest = Manifest(step=step, world_size=4, shards=(), committed_at=at, identity=identity,
                        job="chaos/chaos-0")
    (directory / "manifest.json").write_text(json.dumps(manifest.to_json()))
    return directory


def test_commits_are_read_from_the_trainers_checkpoint_directories(tmp_path: Path) -> None:
    # The directory names carry the attempt after the step (`step-000000020.a0-l1-i0`): the
    # campaign once parsed the whole suffix as the step, saw no commit at all, and so reported
    # 0 steps lost beyond the last commit whatever a resume lost.
    _commit(tmp_path, 10, "a0-l0-i0", 50.0)
    _commit(tmp_path, 20, "a0-l0-i0", 95.0)
    (tmp_path / checkpoint_dir_name(30, "a0-l0-i0")).mkdir()  # still being written
    (tmp_path / "step-000000040.a1-l0-i0").mkdir()
    (tmp_path / "step-000000040.a1-l0-i0" / "manifest.json").write_text("{torn")
    commits = read_commits(tmp_path, {})
    assert commits == {10: 50.0, 20: 95.0}
    # A step committed again by a later attempt keeps its first commit's time.
    _commit(tmp_path, 20, "a1-l0-i0", 300.0)
    assert read_commits(tmp_path, commits) == {10: 50.0, 20: 95.0}
    records = _records((25, "a", 101.0), (11, "b", 130.0))
    result = analyse_fault(FaultResult("j", "pod-kill", 25, 1, injected_at=101.5), records,
                           commits)
    assert result.committed_at_fault == 20
    assert result.steps_lost_beyond_commit == 10


def test_a_campaign_shard_plans_only_what_earlier_shards_left_to_do() -> None:
    done = [{"kind": "hang"}] * 3 + [{"kind": "pod-kill"}] * 7
    counts = still_to_run(["hang", "pod-kill", "sigkill"], 5, done)
    assert counts == {"hang": 2, "pod-kill": 0, "sigkill": 5}
    plans = plan_faults(counts, faults_per_job=4, spacing=25, seed=4, prefix="chaos-s2")
    assert Counter(f.kind for plan in plans for f in plan.faults) == {"hang": 2, "sigkill": 5}
    assert [plan.name for plan in plans] == ["chaos-s2-0", "chaos-s2-1"]
    assert plan_faults(still_to_run(["hang"], 3, done), 4, 25, 4) == []


def test_the_campaign_file_sums_its_shards_and_refuses_other_files(tmp_path: Path) -> None:
    assert read_campaign(tmp_path / "new.json") == {"benchmark": "chaos-campaign", "shards": []}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "goodput"}))
    with pytest.raises(ValueError, match=r"not a bench\.chaos campaign file"):
        read_campaign(other)
    good = FaultResult("j", "hang", 25, 0, recovered=True, seconds=8.0,
                       steps_lost_beyond_commit=0)
    lost = FaultResult("k", "hang", 25, 0, recovered=True, seconds=9.0,
                       steps_lost_beyond_commit=10)
    job = {"final_state": "Succeeded", "final_loss_identical": True}
    shards = [{"faults": [asdict(good)], "jobs": [job]}, {"faults": [asdict(good)], "jobs": [job]}]
    total = campaign_summary(shards)
    assert total["faults"] == 2 and total["jobs"] == 2 and total["by_kind"]["hang"]["faults"] == 2
    assert passed(total)
    shards.append({"faults": [asdict(lost)], "jobs": [job]})
    assert not passed(campaign_summary(shards))


def test_the_campaign_summary_names_every_commit_and_source_its_shards_ran() -> None:
    job = {"final_state": "Succeeded", "final_loss_identical": True}
    shard = {"faults": [], "jobs": [job], "commit": "98608c2aaaaa",
             "operator_and_trainer_source": "f00d"}
    one = campaign_summary([shard, dict(shard)])
    assert one["commits"] == ["98608c2aaaaa"] and one["sources"] == ["f00d"]
    assert render(one).startswith("code: commit 98608c2aaaaa; operator and trainer sources f00d")
    two = campaign_summary([shard, {**shard, "commit": "04ac3d4bbbbb+dirty"}])
    assert two["commits"] == ["04ac3d4bbbbb+dirty", "98608c2aaaaa"]


def test_a_replay_runs_a_recorded_jobs_faults_again_and_names_unknown_jobs() -> None:
    recorded = {"job": "chaos-s0-1", "steps": 75, "final_state": "Failed",
                "faults": [{"kind": "node-partition", "step": 25, "rank": 1},
                           {"kind": "hang", "step": 50, "rank": 3}]}
    campaign = {"benchmark": "chaos-campaign",
                "shards": [{"jobs": [{"job": "chaos-s0-0", "steps": 50, "faults": []}]},
                           {"jobs": [recorded]}]}
    (plan,) = replay_plans(campaign, ["chaos-s0-1"])
    assert plan == JobPlan("chaos-s0-1-replay", 75, (PlannedFault("node-partition", 25, 1),
                                                     PlannedFault("hang", 50, 3)))
    assert plan.trainer_faults() == "50:3:hang"
    with pytest.raises(ValueError, match=r"--replay: no job named chaos-s9-9 "):
        replay_plans(campaign, ["chaos-s0-1", "chaos-s9-9"])
    recorded["faults"] = [{"kind": "meteor", "step": 25, "rank": 0}]
    with pytest.raises(ValueError, match=r"job chaos-s0-1 has unknown fault kinds meteor"):
        replay_plans(campaign, ["chaos-s0-1"])


def test_a_shard_is_added_to_its_campaign_file_after_every_job(tmp_path: Path) -> None:
    from bench.chaos import parse_args
    from bench.chaos_campaign import Shard

    path = tmp_path / "campaign.json"
    earlier = {"benchmark": "chaos", "faults": [asdict(FaultResult("chaos-s0-0", "hang", 25, 1,
                                                                   recovered=True))],
               "jobs": [{"job": "chaos-s0-0", "final_state": "Succeeded",
                         "final_loss_identical": True}]}
    argv = ["--campaign", str(path), "--faults-per-kind", "2"]
    plans = plan_faults({"hang": 1}, 4, 25, 0, prefix="chaos-s1")
    shard = Shard(parse_args(argv), argv, plans, {"shards": [earlier]})
    assert shard.results["command"] == "python -m bench.chaos " + " ".join(argv)
    assert (shard.results["planned_jobs"], shard.results["planned_faults"]) == (1, 1)
    shard.jobs.append({"job": "chaos-s1-0", "final_state": "Failed"})
    shard.faults.append(FaultResult("chaos-s1-0", "hang", 25, 3))
    shard.save(final=False, operator_starts=1)
    written = json.loads(path.read_text())
    assert written["target_faults_per_kind"] == 2
    assert [len(s["jobs"]) for s in written["shards"]] == [1, 1]
    assert written["shards"][1]["operator_starts"] == 1
    assert "finished" not in written["shards"][1]
    assert (written["summary"]["faults"], written["summary"]["recovered"]) == (2, 1)
    assert written["summary"]["jobs_succeeded"] == 1
    shard.save(final=True, operator_starts=2)
    assert "finished" in json.loads(path.read_text())["shards"][1]


def test_a_write_fault_recovers_when_a_later_checkpoint_commits_without_a_restart() -> None:
    records = _records((29, "a", 100.0), (30, "a", 100.5), (45, "a", 110.0))
    error = analyse_fault(FaultResult("j", "write-error", 30, 1, injected_at=100.4), records,
                          commits={20: 95.0, 40: 103.0})
    assert error.recovered and error.seconds == 2.6
    assert error.detail["later_commit_step"] == 40 and not error.detail["restarted"]
    assert error.steps_lost_beyond_commit == 0 and error.committed_at_fault == 20
    # The lost write holds step 40 back until the commit deadline abandons step 30.
    lost = analyse_fault(FaultResult("j", "write-lost", 30, 0, injected_at=100.4), records,
                         commits={20: 95.0})
    assert not lost.recovered and lost.seconds is None
    restarted = analyse_fault(FaultResult("j", "write-lost", 30, 0, injected_at=100.4),
                              [*records, StepRecord(21, "b", 104.0, 1.0)],
                              commits={20: 95.0, 40: 130.0})
    assert not restarted.recovered and restarted.detail["restarted"]
    assert restarted.resumed_step == 20 and restarted.steps_lost_beyond_commit == 0
    # A restart after the later commit is a later fault's, not this one's.
    later = analyse_fault(FaultResult("j", "write-error", 30, 0, injected_at=100.4),
                          [*records, StepRecord(51, "b", 140.0, 1.0)], {20: 95.0, 40: 103.0})
    assert later.recovered and not later.detail["restarted"]


def test_a_removed_checkpoint_directory_counts_from_the_commit_before_it() -> None:
    records = _records((30, "a", 100.0), (21, "b", 120.0))
    result = FaultResult("j", "checkpoint-dir-removed", 30, 0, injected_at=100.4,
                         detail={"removed_step": 30, "removed_committed": True})
    # the campaign dropped step 30's commit when it removed its directory
    analyse_fault(result, records, commits={20: 95.0, 40: 125.0})
    assert result.recovered and result.detail["restarted"]
    assert result.committed_at_fault == 20 and result.resumed_step == 20
    assert result.steps_lost_beyond_commit == 0 and result.seconds == 24.6
    never = FaultResult("j", "checkpoint-dir-removed", 30, 0, injected_at=100.4,
                        detail={"removed_step": 40})
    assert not analyse_fault(never, records, commits={20: 95.0, 40: 125.0}).recovered


def test_a_control_plane_fault_recovers_with_the_job_succeeded_and_no_restart() -> None:
    records = _records((24, "a", 100.0), (40, "a", 140.0))
    detail = {"restarts_before": 0, "restarts_after": 0, "final_state": "Succeeded",
              "status_caught_up_seconds": 3.2}
    quiet = analyse_fault(FaultResult("j", "apiserver-stop", 25, 0, injected_at=101.0,
                                      detail=dict(detail)), records, {20: 90.0})
    assert quiet.recovered and quiet.seconds == 3.2 and quiet.detail["restarts_caused"] == 0
    assert quiet.steps_lost_beyond_commit == 0
    restarted = analyse_fault(
        FaultResult("j", "etcd-restart", 25, 0, injected_at=101.0,
                    detail=detail | {"restarts_after": 1}),
        [*records, StepRecord(21, "b", 150.0, 1.0)], {20: 90.0})
    assert not restarted.recovered and restarted.detail["restarts_caused"] == 1
    assert restarted.resumed_step == 20
    failed = analyse_fault(FaultResult("j", "operator-conn-reset", 25, 0, injected_at=101.0,
                                       detail=detail | {"final_state": "Failed"}), records, {})
    assert not failed.recovered


def test_several_control_plane_faults_share_a_job_and_its_end_decides_each() -> None:
    plans = plan_campaign(list(CONTROL_PLANE_KINDS), per_kind=4, faults_per_job=6, spacing=25,
                          seed=3, control_plane_per_job=4)
    assert [len(plan.faults) for plan in plans] == [4, 4, 4]
    assert Counter(f.kind for plan in plans for f in plan.faults) == dict.fromkeys(
        CONTROL_PLANE_KINDS, 4)
    for plan in plans:
        assert [f.step for f in plan.faults] == [25, 50, 75, 100] and plan.steps == 125
        assert plan.step_seconds() == 2.0
    mixed = plan_campaign(["sigkill", "apiserver-stop"], per_kind=3, faults_per_job=3,
                          spacing=25, seed=3, control_plane_per_job=2)
    assert [[f.kind for f in plan.faults] for plan in mixed] == [
        ["sigkill"] * 3, ["apiserver-stop"] * 2, ["apiserver-stop"]]
    with pytest.raises(ValueError, match="are needed"):
        plan_campaign(["apiserver-stop"], 1, 1, 25, 0, control_plane_per_job=0)
    # a job's end decides every outage of it: a restart after the second counts against both
    records = _records((24, "a", 100.0), (49, "a", 150.0), (60, "a", 170.0))
    first = FaultResult("j", "apiserver-stop", 25, 0, injected_at=101.0,
                        detail={"restarts_before": 0, "status_caught_up_seconds": 2.0})
    second = FaultResult("j", "etcd-restart", 50, 0, injected_at=151.0,
                         detail={"restarts_before": 0, "status_caught_up_seconds": 1.0})
    for result in (first, second):
        control_plane_outcome(result, {"state": "Succeeded", "restarts": {"total": 0}})
        assert analyse_fault(result, records, {20: 90.0}).recovered
        control_plane_outcome(result, {"state": "Succeeded", "restarts": {"total": 1}})
        assert not analyse_fault(result, records, {20: 90.0}).recovered
        assert result.detail["restarts_caused"] == 1


def test_the_newest_checkpoint_directory_in_flight_or_committed(tmp_path: Path) -> None:
    assert newest_checkpoint_dir(tmp_path, 10) is None
    _commit(tmp_path, 10, "a0-l0-i0", 50.0)
    _commit(tmp_path, 20, "a0-l0-i0", 60.0)
    assert newest_checkpoint_dir(tmp_path, 30) is None
    flying = tmp_path / checkpoint_dir_name(30, "a0-l0-i0")
    flying.mkdir()
    (tmp_path / "faults").mkdir()
    assert newest_checkpoint_dir(tmp_path, 30) == flying
    assert newest_checkpoint_dir(tmp_path, 10) == flying


def test_the_operators_connections_are_read_from_proc_net_tcp() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 "
        "       0 1111 1 0000000000000000 100 0 0 10 0\n"
        "   1: 0100007F:C350 0100007F:1A0B 01 00000000:00000000 00:00000000 00000000     0 "
        "       0 2222 1 0000000000000000 20 4 30 10 -1\n"
    )
    assert parse_proc_net_tcp(text) == {2222: ("127.0.0.1", 50000, "127.0.0.1", 6667)}
