"""The trainer's public library for a team's own training script: fast recovery one import away.

Imported by a worker process of a team's own script (the command of a ResilientTrainingJob that
is not the built-in trainer), after it set up its process group. Stable API: `init`, `Run`
(`Run.step`, `Run.finish`, `Run.save`, `Run.heartbeat`) and, for Hugging Face `Trainer`,
`rtj_trainer.lib.hf.RtjCallback`. Everything else in `rtj_trainer` is internal.

A plain torchrun FSDP2 script adopts it in four lines (docs/byo.md; examples/byo/):

    from rtj_trainer import lib as rtj
    run = rtj.init({"model": model, "optimizer": optimizer})   # resumes the newest commit
    for step in range(run.start_step + 1, steps + 1):
        loss = train_step(batch)
        if run.step(step, loss):                                # True: asked to stop
            break
    run.finish()

and gets, with no other code: heartbeats (NVRx's rank monitor and the operator: hang detection),
`status.step`, `status.lastCheckpoint` and goodput in `kubectl get rtj`, async checkpoints of the
state with the trainer's atomic commit (and node-local copies), a checkpoint of the current step
before its pod stops (a suspend, a drain, a preemption), and a resume from the newest commit after
any restart.
"""

from .run import Run, init

__all__ = ["Run", "init"]
