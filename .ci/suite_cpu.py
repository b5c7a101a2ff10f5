"""Where the test suite's CPU goes, process by process, orphans included.

    python .ci/suite_cpu.py [--list KIND] [COMMAND ...]    (default COMMAND: python -m pytest -q -p no:cacheprovider)

Runs COMMAND with the kernel's process accounting on (acct(2): root, or
CAP_SYS_PACCT), which writes one record per process as it exits, whoever reaps
it: Ray's daemons and a fork server's children too, which ``/usr/bin/time``
never sees. This process is COMMAND's subreaper, so that every process COMMAND
starts, orphans included, counts, and no other process on the machine does; it
waits up to 30 s after COMMAND for the last of them to end. While COMMAND
runs, a thread reads each new process's command line from /proc, to tell a
spawned worker from a test's own script; forked children (a loader's workers)
carry the kind of the process they were forked from. ``--list KIND`` (before
COMMAND) also prints each process of that kind with its command line.
Prints the wall time, then the CPU-seconds (user + sys) of each kind of
process. The records round each process's times down a little (13-bit
mantissas), so the total reads a few percent under a ``getrusage`` of the run.
"""
from __future__ import annotations

import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time

RECORD = struct.Struct("<BBHIIIIIIf8H16s")  # struct acct_v3, 64 bytes
AFORK = 0x01  # forked and never exec'd
AHZ = 100     # the records' clock ticks per second
PR_SET_CHILD_SUBREAPER = 36
ACTIVE_ENV = "TORCHFEED_SUITE_CPU_ACTIVE"  # set for COMMAND: accounting is in use

KINDS = [  # (text in the command line, kind), first match wins
    ("multiprocessing.spawn import spawn_main", "spawned workers"),
    ("multiprocessing.forkserver import main", "fork servers"),
    ("multiprocessing.resource_tracker", "resource trackers"),
    ("exec(eval(sys.stdin.readline()))", "pytest-xdist workers"),
    ("torch.distributed.run", "torchrun (agents and ranks)"),
    ("/ray/", "Ray"),
    ("tests/_ray_train.py", "Ray"),  # the Ray Train job's driver
    (" -m pytest", "pytest main processes (the controller, and pytest run by a test)"),
]
INHERITED = ("torchrun (agents and ranks)", "Ray")  # what a launcher starts is the launcher's


def comp_t(value: int) -> int:
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_records(path: str) -> list[dict]:
    records = []
    with open(path, "rb") as f:
        data = f.read()
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        (flag, version, _tty, _exit, _uid, _gid, pid, ppid, _btime, _etime,
         utime, stime, *_rest, comm) = RECORD.unpack_from(data, offset)
        if version & 0x7F != 3:
            raise SystemExit(f"{path}: accounting records of version {version & 0x7F}, not 3")
        records.append({"pid": pid, "ppid": ppid, "forked": bool(flag & AFORK),
                        "cpu": (comp_t(utime) + comp_t(stime)) / AHZ,
                        "comm": comm.split(b"\0")[0].decode(errors="replace")})
    return records


def watch_command_lines(seen: dict[int, str], stop: threading.Event) -> None:
    """Keep ``seen`` (pid: command line) current.  A process is read again
    through its first seconds: seen between fork and exec, it still shows its
    parent's command line."""
    first_seen: dict[int, float] = {}
    while not stop.wait(0.1):
        now = time.monotonic()
        for name in os.listdir("/proc"):
            if not name.isdigit() or now - first_seen.setdefault(int(name), now) > 3.0:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone already
            if cmdline:  # empty once the process is a zombie
                seen[int(name)] = cmdline


def kind_of(record: dict, cmdline: str | None) -> str:
    if record["comm"].startswith("ray::") or record["comm"] in ("raylet", "gcs_server"):
        return "Ray"
    if record["comm"] == "pt_elastic":
        return "torchrun (agents and ranks)"
    if cmdline is None:
        return "not seen running (short-lived)"
    for text, kind in KINDS:
        if text in cmdline:
            return kind
    return "the tests' fresh scripts" if "python" in cmdline.split(" ")[0] else "other programs"


def descendants(records: list[dict], root: int) -> list[dict]:
    """The records of processes whose parents lead to ``root``."""
    parent = {r["pid"]: r["ppid"] for r in records}

    def under_root(pid: int) -> bool:
        for _ in range(100):
            pid = parent.get(pid, 0)
            if pid == root:
                return True
            if pid not in parent:
                return False
        return False

    return [r for r in records if under_root(r["pid"])]


def kinds_of(records: list[dict], cmdlines: dict[int, str]) -> dict[int, str]:
    """Each process's kind: its own, from its command line, unless it was forked
    (then "forked by" its parent's) or started by torchrun or Ray (then theirs)."""
    by_pid = {r["pid"]: r for r in records}
    kinds: dict[int, str] = {}
    for record in sorted(records, key=lambda r: r["pid"]):  # parents first, mostly
        if record["pid"] in kinds:
            continue  # named as an ancestor of an earlier one
        chain = [record]
        while chain[-1]["ppid"] in by_pid and chain[-1]["ppid"] not in kinds and len(chain) < 100:
            chain.append(by_pid[chain[-1]["ppid"]])
        for member in reversed(chain):  # from the oldest ancestor down
            parent = kinds.get(member["ppid"], "").removeprefix("forked by ")
            own = kind_of(member, cmdlines.get(member["pid"]))
            if member["forked"]:
                # A forked process that outlived its parent was reparented to
                # us; its command line is still the parent's.
                origin = parent or own
                kinds[member["pid"]] = origin if origin in INHERITED else f"forked by {origin}"
            elif parent in INHERITED:
                kinds[member["pid"]] = parent
            else:
                kinds[member["pid"]] = own
    return kinds


def reap_orphans(deadline: float) -> None:
    """Wait for the processes COMMAND left behind (reparented to us) to end."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0:
            time.sleep(0.2)


def main(command: list[str], listed: str | None = None) -> int:
    if os.environ.get(ACTIVE_ENV):
        # Accounting is one file for the whole machine: a nested run would
        # take it from the outer one and end it for both.
        raise SystemExit(f"{ACTIVE_ENV} is set: a suite_cpu.py run is counting already")
    os.environ[ACTIVE_ENV] = "1"  # COMMAND inherits it
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.NamedTemporaryFile(prefix="suite-acct-") as log:
        if libc.acct(log.name.encode()) != 0:
            error = os.strerror(ctypes.get_errno())
            raise SystemExit(f"acct(2) failed: {error}. Process accounting needs root "
                             "(or CAP_SYS_PACCT) and a kernel built with it.")
        cmdlines: dict[int, str] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=watch_command_lines, args=(cmdlines, stop), daemon=True)
        watcher.start()
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        start = time.monotonic()
        try:
            returncode = subprocess.call(command)
            wall = time.monotonic() - start
            reap_orphans(deadline=time.monotonic() + 30)
        finally:
            libc.acct(None)
            stop.set()
            watcher.join()
        records = descendants(read_records(log.name), os.getpid())
    kinds = kinds_of(records, cmdlines)
    cpu: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for record in records:
        cpu[kinds[record["pid"]]] += record["cpu"]
        count[kinds[record["pid"]]] += 1
    total = sum(cpu.values())
    print(f"\n{' '.join(command)}: exit {returncode}, {wall:.0f} s wall, "
          f"{total:.0f} CPU-seconds in {len(records)} processes")
    for kind, seconds in cpu.most_common():
        print(f"{seconds:8.1f} {100 * seconds / max(total, 1e-9):5.1f}% {count[kind]:6d}  {kind}")
    for record in sorted(records, key=lambda r: -r["cpu"]):
        if kinds[record["pid"]] == listed:
            cmdline = " ".join(cmdlines.get(record["pid"], record["comm"]).split())
            print(f"  {record['cpu']:6.1f}  {record['pid']}  {cmdline[:160]}")
    return returncode


if __name__ == "__main__":
    args = sys.argv[1:]
    listed = None
    if args[:1] == ["--list"]:
        listed, args = args[1], args[2:]
    sys.exit(main(args or [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], listed))
