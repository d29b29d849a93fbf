"""Runs a command in a /dev/shm of its own, then says what the command's processes left there.

Usage: ``python private_shm.py CMD [ARGS...]``

A test that checks a job leaves nothing in /dev/shm cannot tell the job's files from those
of jobs running beside it (the unit suite runs on two pytest-xdist workers). Here the
command runs in a mount namespace of its own with a fresh tmpfs on /dev/shm (needs root, as
CI has). Once the command has ended and every process of the namespace with it (ranks that
outlive mpirun included, up to ``PRIVATE_SHM_WAIT`` seconds, 30 by default), the last line
on stdout is ``PRIVATE_SHM left=NAME,...`` (empty after ``=`` where nothing was left).
Where no namespace can be made it runs the command in the shared /dev/shm and says
``PRIVATE_SHM unavailable: WHY``. SIGINT, SIGTERM and SIGHUP are passed on to the command;
the exit status is the command's (128+N where signal N ended it).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
# Put in front of a command line: runs it here.
COMMAND = [sys.executable, __file__]


def leftovers(output: str) -> list[str] | None:
    """What the job whose ``output`` this is left in its own /dev/shm; None where it ran in
    the shared one (no report, or no namespace could be made)."""
    report = re.search(r"^PRIVATE_SHM left=(.*)$", output, re.M)
    if report is None:
        return None
    return report[1].split(",") if report[1] else []


def _private_shm() -> str | None:
    """Moves this process to a new mount namespace with an empty /dev/shm; None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    # Private propagation first, or the new tmpfs would show through to the host's namespace.
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None) != 0:
        return f"mount tmpfs /dev/shm: {os.strerror(ctypes.get_errno())}"
    return None


def _others_in_namespace() -> list[int]:
    mine = os.readlink("/proc/self/ns/mnt")
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(entry) != os.getpid() and os.readlink(f"/proc/{entry}/ns/mnt") == mine:
                found.append(int(entry))
        except OSError:  # ended while we looked
            pass
    return found


def main(argv: list[str]) -> int:
    why_not = _private_shm()
    child = subprocess.Popen(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    status = child.wait()
    if why_not is None:
        deadline = time.monotonic() + float(os.environ.get("PRIVATE_SHM_WAIT", "30"))
        while _others_in_namespace() and time.monotonic() < deadline:
            time.sleep(0.05)  # the test itself fails ranks that outlive mpirun
        report = "left=" + ",".join(sorted(os.listdir("/dev/shm")))
    else:
        report = f"unavailable: {why_not}"
    print(f"\nPRIVATE_SHM {report}", flush=True)
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
