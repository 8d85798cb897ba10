"""The job's lifecycle rules: a finished job (rule 1), the Services and the claim (rule 2),
suspend and resume (rule 3), the deadline (rule 4), exit codes that must not be retried
(rule 5), completion (rule 6) and creating what is missing (rule 8).

Faults and their recovery (rule 7) are in `podfaults.py`, `hangs.py` and `recovery.py`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from rtj_operator import builders, naming
from rtj_operator.api.status import LastCheckpoint, ResilientTrainingJobStatus
from rtj_operator.api.vocabulary import ConditionType, JobState, RankState, Reason, StopReason
from rtj_operator.decisions import recovery, status, stops
from rtj_operator.decisions.podfaults import (
    failure_reason,
    following_a_peer,
    training_done,
    training_finished,
)
from rtj_operator.decisions.state import Decision, Pass, from_unix, some, whole_second
from rtj_operator.intents import DeleteJob, DeletePod, Manifest, SetClaimOwner, SyncNetworkPolicy
from rtj_operator.launcher import NO_RESTART_EXIT_CODE, TRAINER_FATAL_EXIT_CODE

# --- rule 1: finished ---------------------------------------------------------------------------


def finished(p: Pass) -> Decision:
    """A finished job: stop whatever still runs, keep the record, honour the TTL."""
    for pod in p.observed.trainer_pods.values():
        if not pod.terminated:
            p.delete_pod(pod, f"the job is {p.prev.state}")
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, f"the job is {p.prev.state}")
    ttl = p.spec.ttl_seconds_after_finished
    completion = p.prev.completion_time
    if ttl is not None and completion is not None and p.now >= completion + timedelta(seconds=ttl):
        p.actions.append(DeleteJob())
        p.event("Normal", "Deleted",
                f"Deleting the job: ttlSecondsAfterFinished={ttl} passed since it finished")
    return status.decision(p, p.prev)


# --- rule 2: services and claim -----------------------------------------------------------------


def ensure_services_and_claim(p: Pass) -> None:
    policy = (builders.network_policy(p.job, plan=p.plan, settings=p.settings)
              if p.settings.network_policy else None)
    digest = builders.network_policy_digest(policy) if policy is not None else None
    if not p.observed.headless_service:
        # The NetworkPolicy goes with the headless Service: the operator lists only pods,
        # services and claims, so a policy deleted by hand comes back with that Service, and
        # the Service records which policy was rendered (its annotation).
        if policy is not None:
            p.create(policy, "ingress only from the job's own pods and the operator")
        p.create(builders.headless_service(p.job, settings=p.settings, network_policy=digest),
                 "DNS names for the trainer pods")
    elif policy is not None and digest is not None and p.observed.network_policy != digest:
        _sync_network_policy(p, policy, digest)
    if not p.observed.rendezvous_service:
        # The budget goes with the rendezvous Service, as the NetworkPolicy with the headless
        # one (the operator lists no budgets).
        if p.spec.fault_tolerance.rendezvous_disruption_budget == "Enabled":
            p.create(builders.rendezvous_disruption_budget(p.job),
                     "no eviction of the rendezvous pod while the job runs")
        p.create(builders.rendezvous_service(p.job, settings=p.settings),
                 "the rendezvous endpoint of ft_launcher")
    checkpoint = p.spec.checkpoint
    if not checkpoint.is_dynamic:
        return
    claim = p.observed.claim
    if claim is None:
        p.create(builders.checkpoint_claim(p.job),
                 f"ReadWriteMany checkpoint volume of StorageClass {checkpoint.storage_class_name}")
        return
    should_own = checkpoint.effective_claim_delete_policy == "Delete"
    if claim.owned_by_job != should_own:
        p.actions.append(
            SetClaimOwner(claim.name, builders.owner_reference(p.job) if should_own else None)
        )
        p.event("Normal", "ClaimDeletePolicy",
                f"Claim {claim.name} is {'owned by' if should_own else 'released from'} the job "
                f"(claimDeletePolicy {checkpoint.effective_claim_delete_policy})")


def _sync_network_policy(p: Pass, policy: Manifest, digest: str) -> None:
    """The job's NetworkPolicy was rendered from other settings than the operator's now (its
    namespace or labels, a Prometheus's, the ranks' ports), or by an operator that did not
    record it: render it again, or a moved operator could read no pod (review-2 F7). With
    `network_policy` off, a policy made earlier is left alone (the operator may hold no right
    on policies then) and goes with the job."""
    p.actions.append(SyncNetworkPolicy(policy, naming.headless_service_name(p.job.name), digest))
    if p.observed.network_policy is not None:
        p.event("Normal", "NetworkPolicyUpdated",
                f"NetworkPolicy {policy['metadata']['name']} rendered again: it no longer "
                f"matched the operator's settings (the operator's or Prometheus's namespace "
                f"or labels, or the ranks' ports)")


# --- rule 3: suspend ----------------------------------------------------------------------------


def suspended(p: Pass) -> Decision:
    """Delete every pod with its own grace period: the trainers commit a checkpoint of the step
    they are at before they exit (rtj_trainer.stop); a pod that said so in its termination
    message is recorded in status.lastStop (reason `Suspended`, or `Preempted` from the
    stop-reason annotation: `stops.record_stop`) and named in the `Suspended` condition."""
    pods = [*p.observed.trainer_pods.values()]
    if p.observed.rendezvous_pod is not None:
        pods.append(p.observed.rendezvous_pod)
    for pod in pods:
        p.delete_pod(pod, "the job is suspended")
    p.waiting.clear()  # on resume every pod starts again and joins the first round
    for index in range(p.pods):
        trainer = p.observed.trainer_pods.get(index)
        p.rank(index, state=RankState.SUSPENDED, pod=trainer.name if trainer else None,
               node=trainer.node_name if trainer else None)
    gone = not pods
    message = ("every pod is deleted; the checkpoints are kept" if gone
               else "deleting the pods; the checkpoints are kept")
    reason, _ = stops.suspend_reason(p.job.metadata.annotations)
    if p.prev.state not in (JobState.SUSPENDED, JobState.QUEUED):
        why = " (preempted)" if reason == StopReason.PREEMPTED else ""
        p.event("Normal", Reason.SUSPENDED, f"Suspended{why}: {message}")
    said = [seen.committed_step for seen in stops.stopped_pods(p)
            if seen.committed_step is not None]
    known = p.prev.last_checkpoint
    if said and (known is None or max(said) >= known.step):
        message = f"{message}; the trainers checkpointed step {max(said)} before stopping"
    written = status.build(
        p, state=JobState.SUSPENDED, reason=Reason.SUSPENDED,
        message=f"The job is suspended: {message}",
        conditions={ConditionType.SUSPENDED: True}, start_time=None, ready_nodes=0,
    )
    # Like a Job, the deadline clock stops while suspended: startTime is set again on resume.
    # Set to None on purpose, so the status patch removes it from the object.
    return status.decision(p, written.model_copy(update={"start_time": None}))


# --- rules 4 and 5: deadline and exit codes that must not be retried ----------------------------


def past_deadline(p: Pass, start_time: datetime) -> Decision | None:
    deadline = p.spec.active_deadline_seconds
    if deadline is None or p.now < start_time + timedelta(seconds=deadline):
        return None
    return recovery.fail(p, Reason.DEADLINE,
                         f"the job ran longer than activeDeadlineSeconds={deadline}", start_time)


def non_retryable_exit(p: Pass, start_time: datetime) -> Decision | None:
    """A trainer that said restarting cannot help (its termination message), a worker or a
    container that exited with a code that must not be retried: Failed at once, even while
    other pods still run."""
    codes = set(p.spec.fault_tolerance.non_retryable_exit_codes)
    for index, pod in sorted(p.observed.trainer_pods.items()):
        outcome = pod.outcome
        if outcome is None or not outcome.failed:
            continue
        said = f": {outcome.message}" if outcome.message else ""
        if outcome.exit_code in codes and outcome.exit_code != TRAINER_FATAL_EXIT_CODE:
            return recovery.fail(
                p, Reason.NON_RETRYABLE,
                f"a worker of pod {pod.name} exited with code {outcome.exit_code}, which is "
                f"listed in nonRetryableExitCodes{said}",
                start_time, failed_index=index,
            )
        return recovery.fail(
            p, Reason.TRAINER_FATAL,
            f"the trainer of pod {pod.name} reported {outcome.reason or 'a fatal error'}{said}",
            start_time, failed_index=index,
        )
    permanent = {NO_RESTART_EXIT_CODE, TRAINER_FATAL_EXIT_CODE, *codes}
    for index, pod in sorted(p.observed.trainer_pods.items()):
        if pod.outcome is not None and pod.outcome.stopped:
            continue  # its trainers checkpointed and stopped on purpose (a lost store: exit 1)
        if following_a_peer(p, pod):
            continue
        if pod.phase == "Failed" and pod.exit_code in permanent:
            return recovery.fail(
                p, Reason.NON_RETRYABLE,
                f"pod {pod.name} exited with code {pod.exit_code}, which is not retryable",
                start_time, failed_index=index,
            )
    return None


def final_progress(p: Pass, written: ResilientTrainingJobStatus) -> ResilientTrainingJobStatus:
    """The final step and newest checkpoint of a job that succeeded: what the trainers said in
    their termination messages (the last scrape may predate the final steps). Without messages
    (a trainer that writes none), the final checkpoint is the best evidence."""
    said = [pod.outcome for pod in p.observed.trainer_pods.values()
            if pod.outcome is not None and not pod.outcome.failed]
    steps = [o.step for o in said if o.step is not None]
    commits = [o for o in said if o.committed_step is not None]
    update: dict[str, Any] = {}
    if steps:
        update["step"] = min(steps)
    if commits:
        newest = max(commits, key=lambda o: o.committed_step or 0)
        assert newest.committed_step is not None
        update["last_checkpoint"] = LastCheckpoint(
            step=newest.committed_step,
            time=(whole_second(from_unix(newest.committed_time))
                  if newest.committed_time is not None else None),
        )
    if steps:
        return written.model_copy(update=update)
    checkpoint = update.get("last_checkpoint", written.last_checkpoint)
    step = written.step if written.step is not None else -1
    if checkpoint is not None and checkpoint.step > step:
        update["step"] = checkpoint.step
    return written.model_copy(update=update)


# --- rule 6: completion -------------------------------------------------------------------------


def completion(p: Pass, start_time: datetime) -> Decision | None:
    """Succeeded when every trainer pod exited 0, or when training is done on every rank
    (`training_done`) and the pods that have not finished never will (`_left_behind`); no
    restarts once one pod has finished."""
    pods = p.observed.trainer_pods
    # A trainer that was asked to stop and checkpointed first also exits 0: not a success.
    succeeded = [i for i, pod in pods.items() if pod.completed_training]
    done = training_done(p)
    if not succeeded and not done:
        return None
    # A replacement still waiting for a launcher round never ran a worker: it cannot finish.
    needed = [i for i in range(p.pods) if i not in p.waiting]
    if all(i in succeeded for i in needed):
        return _succeed(p, start_time, "Every trainer pod exited 0.",
                        "Succeeded: every trainer pod exited 0")
    if done:
        behind = [why for i in needed if (why := _left_behind(p, i)) is not None]
        if not behind:
            return None  # the others are on their way out (torchelastic's exit barrier)
        # The survivors would wait in the exit barrier (up to 300 s) for a pod that never
        # comes, and a replacement would wait for a launcher round nobody else joins.
        lost = some(behind, sep="; ", last="; and ")
        return _succeed(
            p, start_time,
            f"Training finished on every rank, its final checkpoint committed; then {lost}.",
            f"Succeeded: training finished on every rank and its final checkpoint is "
            f"committed; {lost} after that, which loses nothing",
            stop_the_rest=True,
        )
    still_running = [pod for i, pod in pods.items() if not pod.terminated and i not in p.waiting]
    if any(i not in pods for i in needed):
        return recovery.fail(p, Reason.PARTIAL,
                             "some trainer pods succeeded but another one is gone", start_time)
    if not still_running:
        failed = sorted(pod.name for pod in pods.values() if pod.phase == "Failed")
        return recovery.fail(
            p, Reason.PARTIAL,
            f"some trainer pods succeeded but {some(failed)} failed", start_time,
        )
    return None


def _left_behind(p: Pass, index: int) -> str | None:
    """Why the pod of node `index` will never finish on its own although training is done on
    every rank (None: it finished, or it is on its way out): it is gone, failed or ended
    otherwise, is being deleted, is on a lost node, or is a replacement that has not joined
    (it would wait for a launcher round that nobody else joins)."""
    pod = p.observed.trainer_pods.get(index)
    name = naming.trainer_pod_name(p.job.name, index)
    if pod is None:
        return f"pod {name} is gone"
    if training_finished(p, index):
        return None
    if pod.uid in p.lost:
        return f"pod {name} is on lost node {pod.node_name}"
    if pod.phase == "Failed":
        return f"pod {name} failed ({failure_reason(pod)})"
    if pod.terminated:
        return f"pod {name} ended ({pod.phase})"
    if pod.deleting:
        return f"pod {name} is being deleted"
    rank = p.prev_ranks.get(index)
    if pod.phase == "Pending" or (rank is not None and rank.state in (
            RankState.PENDING, RankState.STARTING, RankState.RESTARTING)):
        return f"pod {name} is a replacement that never joined the finished run"
    return None


def _succeed(p: Pass, start_time: datetime, message: str, event: str, *,
             stop_the_rest: bool = False) -> Decision:
    """End the job Succeeded: every needed rank `Succeeded`, waiting spares and the rendezvous
    pod deleted (and, with `stop_the_rest`, every trainer pod still running or starting)."""
    for index, pod in p.observed.trainer_pods.items():
        if index in p.waiting:
            p.delete_pod(pod, "training finished (it was waiting as a spare)")
            continue
        if stop_the_rest and not pod.terminated:
            p.delete_pod(pod, "training finished on every rank")
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               state=RankState.SUCCEEDED)
    for index in range(p.pods):
        if index not in p.observed.trainer_pods and index not in p.waiting:
            p.rank(index, state=RankState.SUCCEEDED)
    p.waiting.clear()
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, "training finished")
    p.event("Normal", Reason.COMPLETED, event)
    status.recover_incidents(p)
    written = status.build(
        p, state=JobState.SUCCEEDED, reason=Reason.COMPLETED, message=message,
        conditions={ConditionType.SUCCEEDED: True, ConditionType.READY: True},
        start_time=start_time, ready_nodes=p.spec.nodes, completion_time=p.now,
    )
    return status.decision(p, final_progress(p, written))


# --- rule 8: create -----------------------------------------------------------------------------


def create_missing(p: Pass) -> None:
    pods = p.observed.trainer_pods
    rendezvous = p.observed.rendezvous_pod
    restarting_all = any(isinstance(a, DeletePod) and a.name == naming.rendezvous_name(p.job.name)
                         for a in p.actions)
    terminating = any(pod.deleting for pod in pods.values()) or any(
        isinstance(a, DeletePod) for a in p.actions
    )
    if rendezvous is None and not terminating:
        _, not_before = recovery.full_restart_backoff(p.incidents)
        if not_before is not None and p.now < not_before:
            p.backoff_until = not_before  # after repeated full restarts: the next pass starts it
            return
        p.create(builders.rendezvous_pod(p.job, plan=p.plan, settings=p.settings),
                 "nvrx-control hosts the rendezvous store")
        p.rendezvous_being_created = True
    rendezvous_up = p.rendezvous_being_created or (
        rendezvous is not None and not rendezvous.deleting and not rendezvous.terminated
        and not restarting_all
    )
    if not rendezvous_up:
        return
    missing = [i for i in range(p.pods) if i not in pods]
    if missing and p.spec.fault_tolerance.fault_injection == "Enabled":
        p.event("Warning", "FaultInjectionArmed",
                "faultTolerance.faultInjection is Enabled: the faults in TRAINER_FAULTS will "
                "fire in the trainers of the pods created now")
    for index in missing:
        attempt = p.next_attempt(index)
        p.create(
            builders.trainer_pod(p.job, plan=p.plan, node_index=index, attempt=attempt,
                                 settings=p.settings, avoid_nodes=[n.node for n in p.excluded]),
            f"trainer for node {index}, attempt {attempt}",
        )
        p.rank(index, state=RankState.PENDING, attempt=attempt,
               pod=naming.trainer_pod_name(p.job.name, index), node=None, step=None,
               last_heartbeat_time=None)
