"""How much shared memory the slots may use, and the check made at iterator start.

The slots are anonymous memfd segments (see ``_slots.py``). They are not files
in ``/dev/shm`` and are not limited by its mount size (Docker's 64 MB default
does not apply to them); they are ordinary shared memory charged to the
machine's RAM and to the process's memory cgroup. So the budget here is:

* an explicit limit, if one is set: the environment variable
  ``TORCHFEED_SHM_LIMIT`` (bytes; ``k``/``m``/``g`` suffixes accepted) or the
  ``shm_limit`` option, the smaller of the two when both are set;
* otherwise half the memory available right now (``MemAvailable``, capped by
  the cgroup's ``memory.max`` minus its current use), so the slots can never
  take the memory the training process itself needs.

The limit exists mainly so tests and cautious users can make the transport
behave as on a machine with little shared memory without filling the real one.

Policy when the slots do not fit (documented in docs/transport.md): torchfeed does not
raise. Batches that do not fit go through torch's own transport, and the main
process warns once, naming the bytes needed, the bytes allowed, where the limit
came from, the free space in ``/dev/shm`` (which torch's transport uses) and the
fix. torchfeed never dies with a bus error on its own slots: every slot is
allocated up front with ``posix_fallocate``, which fails with ``ENOSPC`` or
``ENOMEM`` instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

ENV_LIMIT = "TORCHFEED_SHM_LIMIT"

# Leave the other half of the available memory to the training process.
AVAILABLE_FRACTION = 0.5

_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
           "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
           "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(value, what=ENV_LIMIT) -> int:
    """``value`` (an int, or a string like ``"64m"``) as a number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _SUFFIX:
            raise ValueError(
                f"{what} must be a number of bytes such as 67108864 or 64m, got {value!r}")
        n = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return n


def human(n: float) -> str:
    """``n`` bytes for a person to read."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom():
    """Bytes the memory cgroup still allows, or None when it sets no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":  # cgroup v2
            base = "/sys/fs/cgroup" + parts[2].rstrip("/")
            for d in (base, "/sys/fs/cgroup"):
                limit = _read_int(d + "/memory.max")
                used = _read_int(d + "/memory.current")
                if limit is not None and used is not None:
                    return max(0, limit - used)
            return None
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1
    used = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if limit is not None and used is not None and limit < (1 << 60):
        return max(0, limit - used)
    return None


def available_memory() -> int | None:
    """Bytes of memory a new shared segment could take now (None: unknown)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    head = _cgroup_headroom()
    if head is not None:
        avail = head if avail is None else min(avail, head)
    return avail


def dev_shm_free() -> int | None:
    """Free bytes in /dev/shm, where torch's own transport puts its segments."""
    statvfs = getattr(os, "statvfs", None)  # Windows has neither it nor /dev/shm
    if statvfs is None:
        return None
    try:
        st = statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def configured_limit(option=None):
    """The explicit limit and where it came from, or ``(None, None)``."""
    limits = []
    env = os.environ.get(ENV_LIMIT)
    if env not in (None, ""):
        limits.append((parse_bytes(env), f"{ENV_LIMIT}={env}"))
    if option is not None:
        limits.append((parse_bytes(option, "shm_limit"), f"shm_limit={option!r}"))
    if not limits:
        return None, None
    return min(limits)


@dataclass(frozen=True)
class SpaceCheck:
    """The result of :func:`check_space`."""

    ok: bool
    needed: int
    budget: int
    source: str
    dev_shm_free: int | None

    def message(self, what="the shared-memory transport's slots") -> str:
        """One sentence that says what does not fit and how to fix it."""
        shm = self.dev_shm_free
        where = f"{human(shm)} free there; " if shm is not None else ""
        return (
            f"torchfeed: {what} need {human(self.needed)} of shared memory but only "
            f"{human(self.budget)} is allowed ({self.source}). Batches that do not fit go "
            f"through torch's transport instead, which is slower and keeps its batches in "
            f"/dev/shm ({where}in Docker, give it room with `docker run --shm-size=...`). "
            f"To keep the fast path, raise {ENV_LIMIT} or free memory; pass transport='torch' "
            f"to choose torch's path and silence this warning."
        )


def shm_budget(option=None):
    """Bytes all slots together may use, and a phrase saying why."""
    limit, source = configured_limit(option)
    avail = available_memory()
    if avail is not None:
        half = int(avail * AVAILABLE_FRACTION)
        if limit is None or half < limit:
            return half, f"half of the {human(avail)} of memory available"
    if limit is None:
        return 1 << 62, "no limit known"
    return limit, source


def check_space(bytes_needed: int, option=None) -> SpaceCheck:
    """Whether ``bytes_needed`` bytes of slots fit the shared-memory budget now."""
    budget, source = shm_budget(option)
    return SpaceCheck(ok=bytes_needed <= budget, needed=int(bytes_needed), budget=budget,
                      source=source, dev_shm_free=dev_shm_free())
