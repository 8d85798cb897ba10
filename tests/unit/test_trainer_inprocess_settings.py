"""The in-process wrapper's settings (rtj_trainer.nvrx.inprocess): how long NVRx's monitor thread
waits for other ranks' concurrent failures before it aborts (`last_call_wait`) follows the
ranks there are to wait for. That this reaches NVRx and restarts a real attempt is
tests/e2e/test_trainer_ft_launcher.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_trainer.nvrx.inprocess import WrapperSettings, _wrapper_kwargs


def _settings(active: int, spares: bool) -> WrapperSettings:
    return WrapperSettings(max_iterations=3, active_world_size=active, store_port=29555,
                           soft_timeout=10.0, pod_loss_timeout=30.0, spares=spares,
                           on_cuda=False, gpu_health_checks=False)


@pytest.mark.parametrize(("active", "spares", "wait"), [
    (1, False, 0.0),  # nobody else can fail at the same time
    (1, True, 0.2),   # a spare's failure belongs in the same restart
    (4, False, 0.2),
])
def test_last_call_wait_follows_the_ranks_to_wait_for(active: int, spares: bool,
                                                     wait: float) -> None:
    kwargs = _wrapper_kwargs(_settings(active, spares), before_abort=[], finalize=lambda: None,
                             on_enter=None)
    assert kwargs["last_call_wait"] == timedelta(seconds=wait)
    assert kwargs["soft_timeout"] == timedelta(seconds=10.0)
