"""`python -m rtj_trainer.ftlaunch <ft_launcher arguments>`: NVRx's ft_launcher with a shorter
exit barrier, for jobs with warm spares.

When every worker of a launcher has finished, torchelastic's agent waits in an exit barrier for
every other launcher of the rendezvous round (`exit_barrier_timeout`, 300 s, not a command-line
flag). After a spare took over a lost pod inside the running processes, the lost pod's launcher
never arrives there, so every surviving pod would stay Running five minutes after the job
finished. The barrier only keeps a store-hosting launcher alive for the others; our store lives
in the rendezvous pod (nvrx-control), so a short wait loses nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

EXIT_BARRIER_TIMEOUT_SECONDS = 30.0


def main() -> int:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    timeout = float(os.environ.get("RTJ_EXIT_BARRIER_TIMEOUT_SECONDS",
                                   EXIT_BARRIER_TIMEOUT_SECONDS))
    agent = launcher.LocalElasticAgent
    original = agent.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exit_barrier_timeout", timeout)
        original(self, *args, **kwargs)

    agent.__init__ = __init__  # type: ignore[method-assign]
    sys.argv[0] = "ft_launcher"
    launcher.main()  # exits with ft_launcher's own exit code
    return 0


if __name__ == "__main__":
    sys.exit(main())
