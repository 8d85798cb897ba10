"""Resuming from the state an interrupted attempt reached (rtj_trainer.trainer
`Trainer.offer_live_state`): the model and optimizer state read in place (parallel.live_views) show
the training state as it is, with no process group; `train_step` says when the optimizer starts
changing it; a state offered that way and staged by the wrapper's finalize step is what the next
attempt resumes from, as an uncommitted save of that step ("live")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rtj_trainer import checkpoint as ck
from rtj_trainer import parallel
from rtj_trainer.carry import CarryOver
from rtj_trainer.config import CheckpointConfig
from rtj_trainer.configload import build_config
from rtj_trainer.data import TokenBatches
from rtj_trainer.launchenv import LaunchEnvironment

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank() -> Iterator[parallel.DistributedContext]:
    cfg = build_config(overrides=["train.device=cpu"])
    ctx = parallel.init_distributed(cfg, LaunchEnvironment(), store=dist.HashStore())
    yield ctx
    dist.destroy_process_group()


def _training(ctx: parallel.DistributedContext) -> tuple[Any, Any, Any, TokenBatches]:
    cfg = build_config(overrides=["train.device=cpu"])
    model = parallel.build_model(cfg, ctx)
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    return model, optimizer, scheduler, data


def _step(model: Any, optimizer: Any, scheduler: Any, data: TokenBatches, step: int,
          before_update: Any = None) -> None:
    parallel.train_step(model, optimizer, scheduler, data.batch(step, 0), 1.0,
                        before_update=before_update)


def _flat(state: dict[str, Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    parallel._collect_tensors({k: state[k] for k in (parallel.MODEL, parallel.OPTIMIZER)},
                              tensors)
    return [t.detach().clone() for t in tensors]


def test_the_views_read_the_training_state_in_place_without_a_process_group(
        one_rank: parallel.DistributedContext) -> None:
    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)  # the optimizer state exists from here on
    views = parallel.live_views(model, optimizer,
                                parallel.local_state(model, optimizer, scheduler))
    assert views is not None
    before = _flat(views)
    _step(model, optimizer, scheduler, data, 2)
    now = _flat(views)
    fresh = _flat(parallel.local_state(model, optimizer, scheduler))
    assert len(now) == len(fresh) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(now, fresh, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


def test_a_snapshot_read_through_the_views_is_a_state_dicts_layout_and_values(
        one_rank: parallel.DistributedContext) -> None:
    """Snapshots read the state in place (`Trainer.snapshot_state`) instead of a fresh state
    dict: the same skeleton, tensors and values as `local_state` gives, steps later."""
    from rtj_trainer.checkpoint.staging import flatten_state

    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    first = parallel.local_state(model, optimizer, scheduler)
    views = parallel.live_views(model, optimizer, first)
    assert views is not None
    for step in (2, 3):
        _step(model, optimizer, scheduler, data, step)
    snapshot = parallel.live_state(views, optimizer, scheduler)
    fresh = parallel.local_state(model, optimizer, scheduler)
    read: list[torch.Tensor] = []
    wanted: list[torch.Tensor] = []
    assert flatten_state(snapshot, read) == flatten_state(fresh, wanted)
    assert len(read) == len(wanted) > 0
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(read, wanted, strict=True))


def test_a_state_holding_a_copy_has_no_views(one_rank: parallel.DistributedContext) -> None:
    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    state = parallel.local_state(model, optimizer, scheduler)
    name = next(iter(state[parallel.MODEL]))
    state[parallel.MODEL][name] = state[parallel.MODEL][name].clone()
    assert parallel.live_views(model, optimizer, state) is None


def test_the_update_is_announced_before_any_parameter_changes(
        one_rank: parallel.DistributedContext) -> None:
    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    before = _flat(parallel.local_state(model, optimizer, scheduler))
    seen: list[list[torch.Tensor]] = []
    _step(model, optimizer, scheduler, data, 2,
          before_update=lambda: seen.append(_flat(parallel.local_state(model, optimizer,
                                                                       scheduler))))
    assert len(seen) == 1
    assert all(torch.equal(a, b) for a, b in zip(seen[0], before, strict=True))
    after = _flat(parallel.local_state(model, optimizer, scheduler))
    assert not all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_restart_met_at_the_update_guard_leaves_the_state_of_the_last_step(
        one_rank: parallel.DistributedContext) -> None:
    """The update runs inside the in-process wrapper's atomic section (`update_guard`): a
    restart that began meanwhile holds it, and its exception lands at the guard, before the
    update is announced or any parameter changes (the blocked-rank race, 4 of 14 runs)."""
    import contextlib

    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    before = _flat(parallel.local_state(model, optimizer, scheduler))
    announced: list[bool] = []
    order: list[str] = []

    @contextlib.contextmanager
    def restarting() -> Iterator[None]:
        raise RuntimeError("RankShouldRestart")
        yield  # (unreachable: a generator)

    with pytest.raises(RuntimeError, match="RankShouldRestart"):
        parallel.train_step(model, optimizer, scheduler, data.batch(2, 0), 1.0,
                            before_update=lambda: announced.append(True),
                            update_guard=restarting)
    assert announced == []
    assert all(torch.equal(a, b) for a, b in zip(
        _flat(parallel.local_state(model, optimizer, scheduler)), before, strict=True))

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        order.append("enter")
        yield
        order.append("exit")

    parallel.train_step(model, optimizer, scheduler, data.batch(2, 0), 1.0,
                        before_update=lambda: order.append("update"), update_guard=held)
    assert order == ["enter", "update", "exit"]


def _saved_at_step_1(tmp_path: Path, model: Any, optimizer: Any, scheduler: Any,
                     data: TokenBatches) -> tuple[Path, CheckpointConfig, ck.Checkpointer, Any]:
    """One step, committed (sync) by a first attempt's checkpointer: (store, config, that
    checkpointer, the live views taken at the save)."""
    store = tmp_path / "store"
    config = CheckpointConfig(dir=str(store), interval_steps=0, mode="sync")
    first = ck.Checkpointer(config, root=store, rank=0, world_size=1,
                            device=torch.device("cpu"), identity="a0-l0-i0-1")
    _step(model, optimizer, scheduler, data, 1)
    state = {**parallel.local_state(model, optimizer, scheduler), "step": 1}
    first.save(1, state)
    return store, config, first, parallel.live_views(model, optimizer, state)


def test_a_staged_live_state_is_what_the_next_attempt_resumes_from(
        tmp_path: Path, one_rank: parallel.DistributedContext) -> None:
    model, optimizer, scheduler, data = _training(one_rank)
    store, config, first, views = _saved_at_step_1(tmp_path, model, optimizer, scheduler, data)
    assert views is not None
    for step in (2, 3):
        _step(model, optimizer, scheduler, data, step)
    # The attempt is interrupted after step 3: it offers the state (read in place through the
    # views), closes, and the wrapper's finalize step stages what was offered, once.
    first.offer_live(3, {**parallel.live_state(views, optimizer, scheduler), "step": 3})
    first.close(abort=True)
    assert ck.stage_offered(first.carry) == 3
    assert ck.stage_offered(first.carry) is None
    expected = _flat(parallel.local_state(model, optimizer, scheduler))
    loaded = ck.Checkpointer(config, root=store, rank=0, world_size=1,
                             device=torch.device("cpu"), identity="a0-l0-i1-2",
                             carry=first.carry).load_latest()
    assert loaded is not None and loaded.source == "live" and not loaded.committed
    assert loaded.state["step"] == 3
    assert loaded.directory.name == ck.checkpoint_dir_name(3, "a0-l0-i0-1")
    got = _flat(loaded.state)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert loaded.state[parallel.SCHEDULER]["last_epoch"] == scheduler.state_dict()["last_epoch"]
    groups = loaded.state[parallel.OPTIMIZER]["param_groups"]
    assert [g["lr"] for g in groups] == [g["lr"] for g in optimizer.param_groups]


def test_the_registered_offer_is_made_at_the_finalize_step_when_the_attempt_made_none(
        tmp_path: Path, one_rank: parallel.DistributedContext) -> None:
    # The attempt's own handler was cut short by a repeated restart exception (or never ran):
    # the finalize step makes the offer the attempt registered, once; a withdrawn one is not.
    model, optimizer, scheduler, data = _training(one_rank)
    store, config, first, views = _saved_at_step_1(tmp_path, model, optimizer, scheduler, data)
    assert views is not None
    _step(model, optimizer, scheduler, data, 2)
    offers: list[int] = []

    def offer() -> bool:
        offers.append(2)
        first.offer_live(2, {**parallel.live_state(views, optimizer, scheduler), "step": 2})
        return True

    ck.expect_offer(first.carry, offer)
    first.close(abort=True)
    assert ck.stage_offered(first.carry) == 2
    assert offers == [2]
    assert ck.stage_offered(first.carry) is None and offers == [2]  # made once
    loaded = ck.Checkpointer(config, root=store, rank=0, world_size=1,
                             device=torch.device("cpu"), identity="a0-l0-i1-2",
                             carry=first.carry).load_latest()
    assert loaded is not None and loaded.source == "live" and loaded.state["step"] == 2
    ck.expect_offer(first.carry, offer)
    ck.expect_offer(first.carry, None)  # the attempt ended for good: nothing to resume
    assert ck.stage_offered(first.carry) is None and offers == [2]


def test_an_offer_that_fails_at_the_finalize_step_leaves_the_restart_to_a_copy(
        caplog: pytest.LogCaptureFixture) -> None:
    def offer() -> bool:
        raise RuntimeError("no views")

    carry = CarryOver()
    ck.expect_offer(carry, offer)
    assert ck.stage_offered(carry) is None
    assert "could not offer the interrupted attempt's training state: no views" in caplog.text


def test_the_live_state_has_the_learning_rate_the_scheduler_set_last(
        one_rank: parallel.DistributedContext) -> None:
    # The views' hyperparameters are those of the save they were taken at; an attempt resumed
    # with them took its next step at that save's learning rate (a loss off in the 5th digit
    # one step after an in-process restart, found by the e2e test's bit-for-bit comparison).
    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    views = parallel.live_views(model, optimizer,
                                parallel.local_state(model, optimizer, scheduler))
    assert views is not None
    taken_at = [g["lr"] for g in views[parallel.OPTIMIZER]["param_groups"]]
    for step in (2, 3, 4):  # warmup: the learning rate grows every step
        _step(model, optimizer, scheduler, data, step)
    state = parallel.live_state(views, optimizer, scheduler)
    now = [g["lr"] for g in optimizer.param_groups]
    assert now != taken_at
    assert [g["lr"] for g in state[parallel.OPTIMIZER]["param_groups"]] == now
    fresh = parallel.local_state(model, optimizer, scheduler)
    assert state[parallel.OPTIMIZER]["param_groups"] == fresh[parallel.OPTIMIZER]["param_groups"]
    assert state[parallel.SCHEDULER] == fresh[parallel.SCHEDULER]


def test_optimizer_state_that_is_not_a_tensor_has_no_views(
        one_rank: parallel.DistributedContext) -> None:
    model, optimizer, scheduler, data = _training(one_rank)
    _step(model, optimizer, scheduler, data, 1)
    state = parallel.local_state(model, optimizer, scheduler)
    name = next(iter(state[parallel.OPTIMIZER]["state"]))
    state[parallel.OPTIMIZER]["state"][name]["step"] = 1.0  # a number would go stale
    assert parallel.live_views(model, optimizer, state) is None
