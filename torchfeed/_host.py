"""What this host offers torchfeed: the one place that says which operating-system
capabilities exist here, probed once at import without using any of them.

torch's DataLoader runs on Linux, macOS and Windows; so must ``import torchfeed``
and every feature that needs no Linux primitive.  Code that needs one asks a
flag here (``if _host.SHM_SLOTS:``) instead of naming the primitive where the
module is imported, and where a feature cannot work it degrades to torch's
behaviour and says so once (``tell_once``), or refuses an option that cannot be
honoured with an error that names the platform (``unsupported``).

The flags, each probed by looking, never by calling what it names:

- ``HAS_MEMFD``: ``os.memfd_create`` (Linux 3.17 on): the shared-memory slots'
  arenas and ``torchfeed.share``'s buffers.
- ``HAS_SEALING``: file seals (``fcntl.F_ADD_SEALS``, ``MFD_ALLOW_SEALING``):
  ``torchfeed.share``'s read-only buffers.
- ``HAS_FALLOCATE`` / ``HAS_MADV_REMOVE`` / ``HAS_PUNCH_HOLE``: libc's
  ``fallocate`` (punching holes) and ``MADV_REMOVE``, with which the slots give
  pages back and account for them.
- ``HAS_LIBC``: ``ctypes.CDLL(None)``, libc's ``mmap`` without a descriptor.
- ``SHM_SLOTS``: all the shared-memory transport needs (the above, and
  ``posix_fallocate``, ``pwrite``); ``SHARED_CONTAINERS``: all ``share`` needs.
- ``HAS_POLL``: ``select.poll``; ``HAS_RAW_FD_PIPES``: multiprocessing's pipes
  are file descriptors that ``os.read`` and ``os.write`` take (not Windows'
  handles).  Both: the fd backend of ``_ipc`` (``fd_backend``).
- ``HAS_FORK``: the fork start method; ``HAS_REGISTER_AT_FORK``.
- ``HAS_POSIX_SIGNALS``: ``SIGKILL``, ``SIGBUS``, ``SIGUSR1`` exist: a worker can
  be killed by a signal, and its exit code says which;
  ``HAS_STACK_DUMPS``: ``faulthandler.register`` on ``SIGUSR1``.
- ``HAS_PROC``: ``/proc/self/fd`` (open descriptors, smaps, another process's fds).
- ``HAS_FD_PASSING``: descriptors sent over sockets (``reduction.DupFd``).
- ``HAS_RESOURCE``: the ``resource`` module (``RLIMIT_NOFILE``).

``TORCHFEED_PORTABLE=1`` makes a host that has the fd backend use the portable
one, as Windows must (the CI runs the core tests so); nothing else changes.

mypy checks the package per platform (``.ci/run``: ``--platform darwin`` and
``win32`` with the flags that are false there as ``--always-false``), so code
under ``if _host.HAS_X:`` type-checks where it runs and is skipped where it
cannot.
"""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import multiprocessing
import os
import select
import signal
import sys
import warnings

PORTABLE_ENV = "TORCHFEED_PORTABLE"  # "1": the portable IPC backend even where fds would do

PLATFORM = {"linux": "Linux", "darwin": "macOS", "win32": "Windows"}.get(sys.platform, sys.platform)


class PlatformFallbackWarning(UserWarning):
    """A torchfeed feature this host cannot offer was replaced by torch's behaviour.

    Warned once per process and feature (the shared-memory transport, page-locked
    slots, ``torchfeed.share``), saying what was used instead; filter it by this
    category, ``torchfeed.PlatformFallbackWarning``.  See the Platforms page.
    """


def _libc_has(symbol: str) -> tuple[bool, bool]:
    """(libc loads with ``CDLL(None)``, it has ``symbol``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # Windows: CDLL needs a name
        return False, False
    try:
        getattr(libc, symbol)
    except AttributeError:  # macOS: dlsym(RTLD_DEFAULT, fallocate): symbol not found
        return True, False
    return True, True


def _has_sealing() -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        return False
    return hasattr(fcntl, "F_ADD_SEALS") and hasattr(os, "MFD_ALLOW_SEALING")


def _has_fd_passing() -> bool:
    from multiprocessing import reduction

    return bool(getattr(reduction, "HAVE_SEND_HANDLE", False)) and hasattr(reduction, "DupFd")


def _has_resource() -> bool:
    try:
        import resource  # noqa: F401
    except ImportError:  # Windows
        return False
    return True


def _has_fork() -> bool:
    try:
        return "fork" in multiprocessing.get_all_start_methods()
    except Exception:  # noqa: BLE001 - a Python that cannot say has none we rely on
        return False


HAS_MEMFD = hasattr(os, "memfd_create")
HAS_SEALING = HAS_MEMFD and _has_sealing()
HAS_LIBC, HAS_FALLOCATE = _libc_has("fallocate")
HAS_MADV_REMOVE = hasattr(mmap, "MADV_REMOVE")
HAS_PUNCH_HOLE = HAS_FALLOCATE and HAS_MADV_REMOVE
SHM_SLOTS = (HAS_MEMFD and HAS_PUNCH_HOLE and HAS_LIBC
             and hasattr(os, "posix_fallocate") and hasattr(os, "pwrite"))
SHARED_CONTAINERS = HAS_MEMFD and HAS_SEALING and HAS_LIBC and hasattr(os, "pwrite")
HAS_POLL = hasattr(select, "poll")
HAS_RAW_FD_PIPES = os.name == "posix"
HAS_FORK = _has_fork()
HAS_REGISTER_AT_FORK = hasattr(os, "register_at_fork")
HAS_POSIX_SIGNALS = all(hasattr(signal, name) for name in ("SIGKILL", "SIGBUS", "SIGUSR1"))
HAS_STACK_DUMPS = hasattr(signal, "SIGUSR1") and hasattr(faulthandler, "register")
HAS_PROC = os.path.isdir("/proc/self/fd")
HAS_FD_PASSING = _has_fd_passing()
HAS_RESOURCE = _has_resource()


def fd_backend() -> bool:
    """Whether ``_ipc`` reads and writes the queues' pipes as file descriptors
    (``poll``, ``os.read``, ``os.write``) in this process: where the host
    allows it and ``TORCHFEED_PORTABLE`` does not ask for the portable backend."""
    return HAS_POLL and HAS_RAW_FD_PIPES and os.environ.get(PORTABLE_ENV, "0") in ("", "0")


def capabilities() -> dict[str, bool]:
    """Every flag, by name."""
    return {name: value for name, value in globals().items()
            if (name.startswith("HAS_") or name in ("SHM_SLOTS", "SHARED_CONTAINERS"))
            and isinstance(value, bool)}


_told: set[str] = set()


def tell_once(feature: str, message: str, stacklevel: int = 3) -> None:
    """Say once per process, as a ``PlatformFallbackWarning``, what was used in
    place of ``feature``, which this host cannot offer."""
    if feature in _told:
        return
    _told.add(feature)
    warnings.warn(f"torchfeed on {PLATFORM}: {message}", PlatformFallbackWarning,
                  stacklevel=stacklevel)


def unsupported(what: str, why: str, instead: str) -> ValueError:
    """The error for an option this host cannot honour at all: what, why (what
    the host lacks), and what to use instead."""
    return ValueError(f"torchfeed: {what} cannot be used on this host ({PLATFORM}): {why}. "
                      f"{instead}")


def report() -> str:
    """The flags for a person to read (CI logs: ``python -c "from torchfeed import
    _host; print(_host.report())"``)."""
    lines = [f"platform: {PLATFORM} (sys.platform {sys.platform!r})"]
    lines += [f"{flag:22} {value}" for flag, value in capabilities().items()]
    lines.append(f"{'fd_backend()':22} {fd_backend()}")
    return "\n".join(lines)
