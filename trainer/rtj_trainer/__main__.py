"""`python -m rtj_trainer [--config FILE] [--preset NAME] [--set key=value]...`

Run one trainer worker (normally under `ft_launcher`, which starts one per local rank). Rank 0
prints the summary JSON line as the last line of its output; the exit code is 0 only when the job
reached its last step. An error that restarting cannot fix (`rtj_trainer.errors.FatalError`: a bad
configuration, a checkpoint of other data, checkpoints only at another world size) exits with
`FATAL_EXIT_CODE` (94), which stops ft_launcher's restarts (rtj_trainer.launcher). Local rank 0
writes the pod's termination message (rtj_trainer.termination) at the end and on a fatal error,
when RTJ_TERMINATION_MESSAGE_PATH names the file.

Progress goes through one logger, `rtj_trainer`, set up here: its lines go to stdout as
`[rtj-trainer] ...` (or `[rtj-trainer rank N] ...` for lines every rank writes, logged with
`extra={"rank": N}`). Tests and benchmarks parse some of them (`resumed from ...`, `checkpoint
step ... stall ... s`, `injecting fault ...`), so their text is a contract. Progress is INFO and
always shown; `train.log_level` (RTJ_LOG_LEVEL) sets the level of everything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from rtj_wire.pod import PEER_STOPPED_EXIT_CODE

from . import termination
from .configload import build_config
from .errors import FATAL_EXIT_CODE, FatalError
from .launchenv import launch_environment
from .presets import PRESETS
from .stop import STOP, STOP_NOT_COMMITTED, exit_now, exit_soon, stop_exit_code
from .stop import register as register_stop_signal

if TYPE_CHECKING:
    from .config import Config
    from .metrics import TrainerMetrics
    from .resiliency import Session
    from .train import Finished

log = logging.getLogger("rtj_trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rtj_trainer", description=__doc__)
    parser.add_argument("--config", help="YAML or JSON file with config sections")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="named model/run size (default: the file's 'preset' or tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one field, e.g. train.steps=20")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    return parser.parse_args(argv)


class _PrefixFormatter(logging.Formatter):
    """`[rtj-trainer] message`, `[rtj-trainer rank N] message`; other levels than INFO are named."""

    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", None)
        prefix = "[rtj-trainer]" if rank is None else f"[rtj-trainer rank {rank}]"
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno == logging.INFO:
            return f"{prefix} {message}"
        return f"{prefix} {record.levelname} {record.name}: {message}"


def setup_logging(level: str) -> None:
    """Other libraries (NVRx, torch) log to stderr at `level`, as before; the trainer's own
    logger writes its prefixed lines to stdout, at INFO or below (progress is always shown)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_PrefixFormatter())
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(min(logging.INFO, logging.getLevelName(level)))


def _is_local_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def report_termination(message: termination.TerminationMessage, *,
                       any_rank: bool = False) -> None:
    """Local rank 0 writes the pod's termination message (when the operator asked for one).
    With `any_rank` (a fatal error) another local rank writes it too when none is written yet:
    the first worker to exit with the fatal code makes the launcher shim stop the others, and
    its own message ("worker rank N exited with code 94") would otherwise hide the reason when
    local rank 0 had not reached the error yet (under warm workers, a worker whose warm process
    is still importing starts later than the others)."""
    path = termination.configured_path()
    if path is None:
        return
    if not _is_local_rank_zero() and not (any_rank and not termination.is_written(path)):
        return
    try:
        termination.write(path, message)
    except OSError as exc:
        print(f"rtj_trainer: cannot write the termination message {path}: {exc}", file=sys.stderr)


def fatal(exc: FatalError) -> int:
    """Report an error restarting cannot fix; the exit code stops ft_launcher's restarts."""
    print(f"rtj_trainer: fatal ({exc.reason}): {exc}", file=sys.stderr, flush=True)
    report_termination(termination.TerminationMessage(
        outcome=termination.FAILED, reason=exc.reason, message=str(exc),
        exit_code=FATAL_EXIT_CODE,
    ), any_rank=True)
    return FATAL_EXIT_CODE


def stopped(finished: Finished) -> int:
    """The step loop stopped after committing a checkpoint (rtj_trainer.stop), or after its
    budget ran out first (`Finished.stop_committed`: the message then claims no committed step);
    called inside the in-process wrapper, at once. A worker that was asked to stop exits 0 and
    (local rank 0) says so in the termination message; one that stopped because a peer was
    asked exits PEER_STOPPED_EXIT_CODE, so that its launcher, which was not asked to stop,
    restarts it.
    Either way the process ends with that code within `stop.EXIT_AFTER_STOP_SECONDS`, whether or
    not the wrapper lets it go (`stop.exit_soon`). Returns the exit code."""
    asked = STOP.requested
    if asked and not finished.stop_committed:
        # No committed step is claimed: the operator records no stop, and the job resumes
        # from its newest commit (`finished.committed_step`, named in the message only).
        report_termination(termination.TerminationMessage(
            outcome=termination.STOPPED, step=finished.step,
            reason=STOP_NOT_COMMITTED,
            message=(f"asked to stop after step {finished.step}, but its checkpoint was not "
                     "committed before the pod's termination budget ran out (a rank killed "
                     "before it wrote its shard?); the newest commit is step "
                     f"{finished.committed_step}"),
            exit_code=0,
        ))
    elif asked:
        report_termination(termination.TerminationMessage(
            outcome=termination.STOPPED, step=finished.step,
            committed_step=finished.committed_step, committed_time=finished.committed_time,
            checkpoint=(str(finished.committed_dir)
                        if finished.committed_dir is not None else None),
            reason="CheckpointedBeforeStop",
            message=(f"checkpointed step {finished.committed_step} before stopping (asked by "
                     f"ft_launcher after the pod's SIGTERM"
                     f"{', as was every rank' if finished.everyone_stopped else ''})"),
            exit_code=0,
        ))
    log.info("stopped at step %d (%s): %s", finished.step,
             f"checkpoint of step {finished.committed_step} committed"
             if finished.stop_committed else
             f"its checkpoint not committed; newest commit: step {finished.committed_step}",
             "asked to stop" if asked else f"a peer was asked to stop; exiting "
             f"{PEER_STOPPED_EXIT_CODE} so that ft_launcher restarts this worker",
             extra={"rank": launch_environment().rank})
    code = stop_exit_code(asked)
    exit_soon(code)
    return code


def train_and_report(cfg: Config, session: Session, metrics: TrainerMetrics) -> Finished:
    """One attempt (`train.train`); a stop is reported at once (`stopped`), before the
    in-process wrapper is left."""
    from .train import train

    finished = train(cfg, session, metrics)
    if finished.stopped:
        stopped(finished)
    return finished


def main(argv: list[str] | None = None) -> int:
    from . import timeline

    started = timeline.process_start_time()
    if started is not None and "process_start" not in timeline.marks():  # a warm worker's is set
        timeline.mark("process_start", started)
    timeline.mark("main")
    args = parse_args(argv)
    try:
        cfg = build_config(preset=args.preset or ("tiny" if args.config is None else None),
                           file=args.config, overrides=args.overrides)
        launch = launch_environment()
    except FatalError as exc:
        return fatal(exc)
    if args.print_config:
        print(json.dumps(cfg.model_dump(), indent=1))
        return 0
    setup_logging(cfg.train.log_level)
    # This worker commits a checkpoint of its step when its pod ends (SIGUSR2: rtj_trainer.stop);
    # the launcher shim sends that signal only to workers that say so.
    register_stop_signal()
    if cfg.train.dump_stacks_on_sigterm:
        import faulthandler
        import signal

        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    # Heavy imports only after the config is known to be valid.
    from .metrics import TrainerMetrics
    from .resiliency import Resiliency, waiting_as_spare

    timeline.mark("imports")
    metrics = TrainerMetrics(rank=launch.rank, local_rank=launch.local_rank, job=cfg.job.name,
                             attempt=cfg.job.attempt)
    metrics.standby = waiting_as_spare
    if cfg.metrics.port is not None:
        port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
        log.info("metrics on http://%s:%d/metrics", cfg.metrics.host, port,
                 extra={"rank": launch.rank})
    resiliency = Resiliency(cfg, launch)
    from .checkpoint import ProcessWriter

    writers = ProcessWriter(resiliency.carry)
    if cfg.checkpoint.mode == "async" and cfg.checkpoint.interval_steps:
        # Start the checkpoint writer process now, while the launcher's other workers start
        # too: a warm spare then has one ready when it takes over, and every attempt of this
        # process reuses it (ProcessWriter).
        writers.prestart(launch.rank)
    try:
        finished = resiliency.run(lambda session: train_and_report(cfg, session, metrics))
    except FatalError as exc:
        return fatal(exc)
    finally:
        writers.release()  # an idle writer no attempt took must not outlive the process
        resiliency.close()
        metrics.close()
    if finished.stopped:
        # Everything is closed, the checkpoint committed and the stop reported (`stopped`).
        # The rank monitor was signalled with the launcher and is gone: leave without the
        # interpreter's own shutdown (`stop.exit_now`).
        exit_now(stop_exit_code(STOP.requested))
    report_termination(termination.TerminationMessage(
        outcome=termination.SUCCEEDED, step=finished.step,
        committed_step=finished.committed_step, committed_time=finished.committed_time,
        reason="Completed", message=f"training reached step {finished.step}", exit_code=0,
    ))
    if finished.summary is not None:
        print(json.dumps(finished.summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
