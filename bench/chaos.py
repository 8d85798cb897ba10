"""A fault campaign on Kubernetes: many faults of every kind over several jobs, each job checked
for the three things a user cares about.

Starts the local cluster (real control plane, three process-backed p5-like nodes; tests/harness)
and the operator, trains one fault-free reference job, then runs the campaign's jobs one after
the other. Each job is examples/cpu-tiny.yaml's shape (2 pods x 2 ranks of the tiny CPU trainer
under ft_launcher, in-process restart on, checkpoints every `--checkpoint-interval` steps) with
`--faults-per-job` faults, one every `--spacing` steps. The fault kinds:

- `exception`, `sigkill`, `hang`: `TRAINER_FAULTS` (on one rank at the planned step the trainer
  raises, SIGKILLs its own worker, or stops making progress while alive);
- `pod-kill`: the harness SIGKILLs every process of pod `<job>-1`;
- `node-partition`: the harness partitions the node that runs pod `<job>-1` (no Lease, no status,
  frozen processes) and heals it once the job trains again, or, when the job's rendezvous pod
  runs there too, as soon as the operator has force-deleted that pod (a harness limit: see
  `chaos_faults.FaultKinds.heal_once_rendezvous_replaced`);
- `rendezvous-kill`: the harness SIGKILLs the rendezvous pod `<job>-rdzv`;
- `operator-kill`: pod `<job>-1` is killed and the operator is SIGKILLed as soon as it acted on
  it, then started again;
- `writer-kill`: the asynchronous checkpoint writer process of one rank's pod is SIGKILLed.

Storage faults, on a checkpoint step (the one nearest the planned step; a job's commit deadline,
`checkpoint.commit_timeout_seconds`, is `--commit-timeout`, 20 s, not the trainer's 600 s):
- `write-error`: `TRAINER_FAULTS`: one rank's shard write fails with EIO and leaves its `.error`
  record;
- `write-lost`: `TRAINER_FAULTS`: the shard write fails and leaves no record at all (EIO, ENOSPC,
  ESTALE, the directory gone), so only the commit deadline gives the save up;
- `checkpoint-dir-removed`: the campaign `rm -rf`s the job's newest checkpoint directory, still
  being written or already committed, under the running job.
Recovered: the job commits a checkpoint of a later step (seconds: fault -> that commit); a write
fault with no restart before it (the trainer abandons the save and goes on). `write-lost` and
`checkpoint-dir-removed` can hold later commits back for the deadline, so each is the last fault
of its job, one a job.

Control-plane faults, **alone in jobs of their own** (`--control-plane-per-job` of them to a
job, 1 by default, one every `--spacing` steps, the job `--spacing` steps longer than its last,
paced at 2 s a step so each outage falls mid-training): the control plane is the whole
cluster's, and a job's restarts are only the outages' doing when nothing else happens:
- `apiserver-stop`: kube-apiserver is stopped for `--apiserver-down-seconds` (30), then started
  again on the same port, certificates and etcd;
- `etcd-restart`: etcd is stopped and started again on the same data directory;
- `operator-conn-reset`: every TCP connection of the operator to kube-apiserver is reset
  (`ss -K`; needs root or CAP_NET_ADMIN).
Recovered: the job ends Succeeded with no restart from the fault on (status.restarts.total
just before the fault and at the job's end: with several outages in a job, a restart after any
of them counts against every earlier one too); seconds: the server back -> the job's status
caught up with the training done meanwhile (status.step at least rank 0's step at the return;
the target is <= 10 s).

For every fault it reports: recovered or not; the seconds from the fault to the first completed
step after it (rank 0's `losses.jsonl`; the storage and control-plane faults: as above); the
step training resumed from and the newest checkpoint committed when the fault happened; and the
**steps lost beyond the last commit** (committed step minus resumed step, 0 when the job resumed
from the newest commit or did not restart; a removed checkpoint no longer counts as committed).
For every job: the final state, and whether the final loss is bit-identical to the reference
job's.

Targets (issue 11): every job Succeeded, 0 steps lost beyond the last committed checkpoint,
final loss identical to the fault-free run.

The steps lost beyond the last commit compare the resumed step with the newest checkpoint whose
manifest was committed before the fault (`read_commits`: the manifests' own `step` and
`committed_at`).

The first eight kinds' campaign (100 faults of each, about 200 jobs) took ten hours on a 2-core
machine, more than one working session (and a control-plane fault's job alone takes 2-3
minutes), so a campaign can be run in shards that add up in one campaign file: each shard plans
only the faults of each kind that the earlier shards have not injected yet, starts no new job
after `--minutes`, records the commit it ran at, and rewrites the file after every job (a shard
cut short keeps its finished jobs). The file's `summary` covers every shard.

    python -m bench.chaos --faults-per-kind 100 --out bench/results/chaos.json  # all at once
    python -m bench.chaos --campaign bench/results/chaos-campaign.json --minutes 60  # a shard
    python -m bench.chaos --faults-per-kind 2 --out /tmp/chaos.json             # a smoke run
    python -m bench.chaos --kinds write-error,write-lost,apiserver-stop --faults-per-kind 1 \
        --out /tmp/chaos-storage.json                                            # some kinds
    python -m bench.chaos --campaign bench/results/chaos-campaign.json \
        --replay chaos-s0-1 --out /tmp/replay.json     # a recorded job's faults, again
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from .chaos_campaign import DEFAULT_COMMIT_TIMEOUT, Shard
from .chaos_plan import KINDS, JobPlan, plan_campaign, plan_faults, replay_plans, still_to_run
from .chaos_results import campaign_summary, passed, read_campaign, render
from .common import add_output_arguments

# The campaign's parts: chaos_plan (the fault kinds, the plan, a replay's plan), chaos_results
# (what a fault cost, the summary, the campaign file), chaos_cluster (the cluster, the operator,
# reading a job), chaos_faults (injecting each kind), chaos_campaign (a job with its faults, a
# shard's results). This module is the command line.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated fault kinds (default all: {','.join(KINDS)})")
    parser.add_argument("--faults-per-kind", type=int, default=100,
                        help="faults of each kind in the campaign (default 100); with --campaign, "
                             "the campaign's total over all its shards")
    parser.add_argument("--faults-per-job", type=int, default=4,
                        help="faults in one job (default 4)")
    parser.add_argument("--control-plane-per-job", type=int, default=1,
                        help="control-plane faults in one job of their own (default 1)")
    parser.add_argument("--spacing", type=int, default=25,
                        help="steps between two faults of a job (default 25)")
    parser.add_argument("--checkpoint-interval", type=int, default=10,
                        help="checkpoint.intervalSteps (default 10)")
    parser.add_argument("--commit-timeout", type=float, default=DEFAULT_COMMIT_TIMEOUT,
                        help="the jobs' checkpoint.commit_timeout_seconds (default "
                             f"{DEFAULT_COMMIT_TIMEOUT:g}; the trainer's own: 600): how long a "
                             "save whose shard write was lost (write-lost) blocks later commits")
    parser.add_argument("--apiserver-down-seconds", type=float, default=30.0,
                        help="how long apiserver-stop keeps kube-apiserver stopped (default 30)")
    parser.add_argument("--seed", type=int, default=11,
                        help="shuffle seed (default 11; with --campaign, plus the shard's number)")
    parser.add_argument("--job-timeout", type=float, default=900.0,
                        help="give up on one job after this many seconds (default 900)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no new job after this many minutes (default: no limit); the "
                             "jobs not started stay for the campaign's next shard")
    parser.add_argument("--campaign", type=Path, default=None,
                        help="a campaign file: run one more shard of it (the faults of each kind "
                             "still missing from --faults-per-kind), add the shard to the file "
                             "after every job, and summarise every shard together")
    parser.add_argument("--replay", action="append", default=[], metavar="JOB",
                        help="run this job of --campaign again with its recorded faults (the "
                             "same steps, kinds and ranks) at today's code (repeatable); the "
                             "results go to --out and the campaign file is left as it is")
    add_output_arguments(parser, work_dir_help="cluster run directory (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.replay and args.campaign is None:
        parser.error("--replay needs --campaign (the file the jobs are read from)")
    return args


def plans_to_run(args: argparse.Namespace,
                 campaign: dict[str, Any] | None) -> list[JobPlan]:
    """The jobs this run starts: the recorded jobs of `--replay`, a new campaign's, or the next
    shard's of a campaign file (none when its every kind has its faults already)."""
    kinds = [k for k in args.kinds.split(",") if k]
    if args.replay:
        assert campaign is not None
        return replay_plans(campaign, args.replay)
    if campaign is None:
        return plan_campaign(kinds, args.faults_per_kind, args.faults_per_job, args.spacing,
                             args.seed, interval=args.checkpoint_interval,
                             control_plane_per_job=args.control_plane_per_job)
    number = len(campaign["shards"])
    done = [f for shard in campaign["shards"] for f in shard.get("faults", [])]
    return plan_faults(still_to_run(kinds, args.faults_per_kind, done), args.faults_per_job,
                       args.spacing, args.seed + number, prefix=f"chaos-s{number}",
                       interval=args.checkpoint_interval,
                       control_plane_per_job=args.control_plane_per_job)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    campaign_data = read_campaign(args.campaign) if args.campaign else None
    plans = plans_to_run(args, campaign_data)
    if args.replay:
        campaign_data = None  # a replay writes --out, never the campaign file
    elif campaign_data is not None and not plans:
        print(f"[bench.chaos] {args.campaign}: every kind has its {args.faults_per_kind} "
              "faults already")
        print(render(campaign_summary(campaign_data["shards"])))
        return 0 if passed(campaign_summary(campaign_data["shards"])) else 1
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-chaos."))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    shard = Shard(args, argv, plans, campaign_data)
    shard.run(plans, work_dir)
    results = shard.results
    print(render(results["summary"]))
    if campaign_data is not None:
        total = campaign_summary([*campaign_data["shards"], results])
        print(f"\nthe whole campaign ({len(campaign_data['shards']) + 1} shards):")
        print(render(total))
        print(f"\nJSON: {args.campaign}")
        return 0 if passed(results["summary"]) and passed(total) else 1
    if args.out:
        print(f"\nJSON: {args.out}")
    return 0 if passed(results["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
