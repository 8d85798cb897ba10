"""`python -m harness up|down|status`: the test cluster as a background service for manual work.

`up` builds the binaries if needed, then starts a detached daemon (own session, no terminal) that
runs `Cluster.start` (and, with `--kueue`, `Kueue.start`: real Kueue, see harness.kueue) and waits
for SIGTERM; once the cluster is ready it writes `<dir>/env` (source
it: exports KUBECONFIG and puts the binaries and the project venv first on PATH) and `<dir>/pids`.
`down` stops the daemon (which stops everything it started) and then kills anything listed in
`<dir>/pids` that still runs, so no process is left behind. Backs `make cluster-up/cluster-down`
(run from the repository root with PYTHONPATH=tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from harness import cgroups
from harness.cluster import VENV_BIN, Cluster, python_module_argv, without_tests_on_pythonpath
from harness.controlplane import ensure_binaries
from harness.kueue import Kueue, ensure_kueue

START_TIMEOUT = 240.0
STOP_TIMEOUT = 60.0
RUN_DIR_ENTRIES = [
    "env", "pids", "daemon.log", "admin.kubeconfig", "nodes.json", "etcd-data", "pki", "logs",
    "pods", "pod-data", "shared", "kueue",
]  # fmt: skip


def read_pids(run_dir: Path) -> dict[str, int]:
    path = run_dir / "pids"
    if not path.exists():
        return {}
    pids = {}
    for line in path.read_text().splitlines():
        name, _, pid = line.partition(" ")
        if pid.strip().isdigit():
            pids[name] = int(pid)
    return pids


def is_ours(pid: int, run_dir: Path) -> bool:
    """True when `pid` runs and its command line names our run dir (guards against PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and str(run_dir) in cmdline


def up(run_dir: Path, nodes: int, kueue: bool = False) -> int:
    daemon_pid = read_pids(run_dir).get("daemon")
    if daemon_pid and is_ours(daemon_pid, run_dir):
        print(f"cluster already up (daemon pid {daemon_pid}); source {run_dir / 'env'}")
        return 0
    t0 = time.monotonic()
    ensure_binaries()
    if kueue:
        ensure_kueue()
    run_dir.mkdir(parents=True, exist_ok=True)
    for entry in RUN_DIR_ENTRIES:  # only what an earlier cluster left here
        path = run_dir / entry
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    env = without_tests_on_pythonpath(dict(os.environ))  # `make cluster-up` sets PYTHONPATH
    with open(run_dir / "daemon.log", "ab") as log:
        daemon = subprocess.Popen(
            [
                *python_module_argv("harness.__main__"),
                "_daemon",
                f"--dir={run_dir}",
                f"--nodes={nodes}",
                *(["--kueue"] if kueue else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    while not (run_dir / "env").exists():
        if daemon.poll() is not None or time.monotonic() - t0 > START_TIMEOUT:
            if daemon.poll() is None:
                daemon.terminate()
            tail = (run_dir / "daemon.log").read_text(errors="replace").splitlines()[-30:]
            print("cluster failed to start:\n" + "\n".join(tail), file=sys.stderr)
            return 1
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    with_kueue = " and Kueue" if kueue else ""
    print(f"cluster up in {elapsed:.1f} s with {nodes} nodes{with_kueue}; run: source "
          f"{run_dir / 'env'}")
    return 0


def daemon(run_dir: Path, nodes: int, kueue: bool = False) -> int:
    def stop(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(0)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    cluster = Cluster.start(run_dir, nodes=nodes)
    queueing: Kueue | None = None
    try:
        if kueue:
            queueing = Kueue.start(cluster)
        pids = {"daemon": os.getpid(), **cluster.pids()}
        if queueing is not None:
            pids["kueue"] = queueing.process.pid
        (run_dir / "pids").write_text("".join(f"{name} {pid}\n" for name, pid in pids.items()))
        (run_dir / "env.tmp").write_text(
            "# Source me: the cluster started by `python -m harness up`.\n"
            f"export KUBECONFIG={cluster.kubeconfig}\n"
            f"export PATH={cluster.bin_dir}:{VENV_BIN}:$PATH\n"
        )
        (run_dir / "env.tmp").rename(run_dir / "env")
        print(f"cluster ready: {json.dumps(cluster.timings)}", flush=True)
        while True:
            signal.pause()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # let the teardown finish
        print("stopping", flush=True)
        if queueing is not None:
            queueing.stop()
        cluster.stop()
        (run_dir / "env").unlink(missing_ok=True)
        print("stopped", flush=True)


def down(run_dir: Path) -> int:
    pids = read_pids(run_dir)
    daemon_pid = pids.get("daemon")
    if daemon_pid and is_ours(daemon_pid, run_dir):
        os.kill(daemon_pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while is_ours(daemon_pid, run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    leftovers = [name for name, pid in pids.items() if is_ours(pid, run_dir)]
    for name in leftovers:
        try:
            os.killpg(pids[name], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    state_file = run_dir / "nodes.json"
    if state_file.exists():
        group = json.loads(state_file.read_text()).get("cgroup")
        if group and Path(group).exists():
            cgroups.signal_all(Path(group), signal.SIGKILL)
            cgroups.remove(Path(group))
    (run_dir / "pids").unlink(missing_ok=True)
    (run_dir / "env").unlink(missing_ok=True)
    note = f" (killed leftovers: {', '.join(leftovers)})" if leftovers else ""
    print(f"cluster down{note}" if pids else "cluster was not running")
    return 0


def status(run_dir: Path) -> int:
    pids = read_pids(run_dir)
    if not pids:
        print("cluster is not running")
        return 1
    running = True
    for name, pid in pids.items():
        alive = is_ours(pid, run_dir)
        running = running and alive
        print(f"{name:26} {pid:>8}  {'running' if alive else 'NOT RUNNING'}")
    if (run_dir / "env").exists():
        print(f"source {run_dir / 'env'}")
    return 0 if running else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "_daemon"):
        command = commands.add_parser(name)
        command.add_argument("--dir", type=Path, default=Path(".cluster"))
        if name in ("up", "_daemon"):
            command.add_argument("--nodes", type=int, default=3)
            command.add_argument("--kueue", action="store_true",
                                 help="also run real Kueue (v0.17.0, hack/build-kueue.sh)")
    args = parser.parse_args(argv)
    run_dir = args.dir.resolve()
    if args.command == "up":
        return up(run_dir, args.nodes, args.kueue)
    if args.command == "_daemon":
        return daemon(run_dir, args.nodes, args.kueue)
    if args.command == "down":
        return down(run_dir)
    return status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
