"""Pre-exec step: run one command with extra files laid over /etc, seen by it alone.

`python -S etcoverlay.py <dir> -- <argv...>` enters a new mount namespace, makes every mount
private, mounts a read-only overlay on /etc whose upper layer is `<dir>` and whose lower layer is
the host's /etc, and execs `argv`. Nothing changes on the host: no file or directory appears in
its /etc, and another process started the same way with another `<dir>` sees its own files.

Why: Kueue's controller manager reads its metrics serving certificate from the fixed path
`/etc/kueue/metrics/certs/tls.{crt,key}` whenever its internal certificate management is off
(cmd/kueue/main.go in v0.17.0; there is no setting for that path), and the harness runs it with
certificates signed by the cluster's own CA (harness.kueue). Stdlib only, like podinit.py.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    result = _libc.mount(
        source.encode() if source else None, target.encode(),
        fstype.encode() if fstype else None, ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or source} -> {target}: {os.strerror(errno)}")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit("usage: etcoverlay.py <dir> -- <argv...>")
    upper, argv = os.path.abspath(sys.argv[1]), sys.argv[3:]
    if any(c in upper for c in ",:\\"):
        raise SystemExit(f"etcoverlay: {upper!r} cannot be an overlay layer (',', ':' or '\\')")
    _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    os.unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Two lower layers and no upper one: a read-only union, `upper` first (it wins).
    _mount("overlay", "/etc", "overlay", MS_RDONLY, f"lowerdir={upper}:/etc")
    sys.stdout.flush()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
