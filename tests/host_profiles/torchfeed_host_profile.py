"""A simulated host: this Linux machine as macOS or Windows, for torchfeed's code.

``sitecustomize.py`` beside this file installs a profile when
``TORCHFEED_HOST_PROFILE`` is ``macos`` or ``windows`` and this folder is on
``PYTHONPATH``; every interpreter started with that environment installs it
too, spawned DataLoader workers included.  A simulation, not proof: see the
README's platform table for what ran on a real host (nothing but Linux).

Two layers:

* What any program sees on that host, patched globally because torch and the
  standard library read it there too: the start methods (Windows: spawn only;
  macOS: spawn by default) and torch's sharing strategy (``file_system``, the
  default on both).
* What torchfeed's own code sees: an import hook gives every module of the
  ``torchfeed`` package, and only those, views of ``os``, ``signal``,
  ``select``, ``mmap``, ``ctypes``, ``fcntl``, ``faulthandler``, ``socket``,
  ``sys`` and ``multiprocessing.reduction`` without what that host lacks
  (``import fcntl`` and ``import resource`` fail on Windows), and its
  ``open``/``os.listdir``/``os.path`` find no ``/proc`` (neither host has one).
  torch and the standard library keep the real modules: they work on those
  hosts on their own terms (``multiprocessing.connection.wait`` is
  WaitForMultipleObjects there, poll here), which this cannot simulate.

Windows' view also behaves as Windows does where a Linux habit would go wrong:
``os.name`` is ``"nt"``; ``os.kill(pid, 0)``, a liveness check on POSIX, sends
Ctrl-C there (``CTRL_C_EVENT`` is 0; simulated with SIGINT) and any other
signal terminates the process; ``os.read``/``os.write`` on a pipe fail
(multiprocessing's pipes are handles, not file descriptors).

What it cannot simulate: the real kernels (macOS's and Windows' pipes, shared
memory, scheduling), Windows' named pipes and process handles behind
``multiprocessing``, exit codes of crashed Windows processes (NTSTATUS codes,
not signals), torch's own platform code paths (``torch`` still runs its Linux
code), and anything a C extension does.
"""
from __future__ import annotations

import builtins
import errno
import importlib.abc
import os
import stat
import sys
import types

_REAL_IMPORT = builtins.__import__
_REAL_OPEN = builtins.open

# The signals Windows has (everything else in ``signal`` is POSIX's).
_WINDOWS_SIGNAL_NAMES = {"SIGINT", "SIGTERM", "SIGABRT", "SIGFPE", "SIGILL", "SIGSEGV",
                         "SIGBREAK", "SIG_DFL", "SIG_IGN", "NSIG", "CTRL_C_EVENT",
                         "CTRL_BREAK_EVENT", "signal", "getsignal", "default_int_handler",
                         "Signals", "Handlers", "strsignal", "raise_signal", "valid_signals",
                         "set_wakeup_fd"}
_WINDOWS_MMAP_NAMES = {"mmap", "PAGESIZE", "ALLOCATIONGRANULARITY", "ACCESS_READ",
                       "ACCESS_WRITE", "ACCESS_COPY", "ACCESS_DEFAULT", "error"}
_MACOS_MADVISE = {"MADV_NORMAL", "MADV_RANDOM", "MADV_SEQUENTIAL", "MADV_WILLNEED",
                  "MADV_DONTNEED", "MADV_FREE", "MADV_FREE_REUSABLE", "MADV_FREE_REUSE"}


def _prefixed(*prefixes: str):
    return lambda name: name.startswith(prefixes)


# Per profile and module: a predicate on the names the host lacks, or None for a
# module the host does not have at all.
PROFILES: dict[str, dict] = {
    "macos": {
        "os": _prefixed("memfd_create", "MFD_", "posix_fallocate", "posix_fadvise", "pipe2",
                        "sched_", "splice", "eventfd", "pidfd_", "copy_file_range",
                        "EFD_", "SPLICE_", "O_PATH", "O_TMPFILE", "O_DIRECT", "O_NOATIME",
                        "O_LARGEFILE", "RWF_", "MFD_", "getxattr", "setxattr", "listxattr"),
        "mmap": lambda name: ((name.startswith("MADV_") and name not in _MACOS_MADVISE)
                              or name in ("MAP_POPULATE", "MAP_STACK", "MAP_DENYWRITE",
                                          "MAP_EXECUTABLE")),
        "fcntl": _prefixed("F_ADD_SEALS", "F_GET_SEALS", "F_SEAL_", "F_OFD_", "F_SETPIPE_SZ",
                           "F_GETPIPE_SZ"),
        "select": _prefixed("epoll", "EPOLL"),
        "signal": _prefixed("SIGRTMIN", "SIGRTMAX", "SIGPOLL", "SIGPWR", "SIGSTKFLT",
                            "sigtimedwait", "sigwaitinfo"),
        "socket": _prefixed("SO_PEERCRED", "AF_NETLINK", "AF_PACKET"),
        "libc": ("fallocate", "memfd_create", "posix_fallocate64"),
        "platform": "darwin",
    },
    "windows": {
        "os": _prefixed("fork", "register_at_fork", "memfd_create", "MFD_", "posix_", "pwrite",
                        "pread", "set_blocking", "get_blocking", "getuid", "geteuid", "getgid",
                        "getegid", "getgroups", "getpgid", "getpgrp", "setpgrp", "setsid",
                        "killpg", "sched_", "getloadavg", "statvfs", "fstatvfs", "O_CLOEXEC",
                        "O_NONBLOCK", "O_NOCTTY", "O_SYNC", "O_DSYNC", "WNOHANG", "WUNTRACED",
                        "wait3", "wait4", "pipe2", "sysconf", "sync", "mkfifo", "mknod",
                        "sendfile", "F_", "POSIX_", "RWF_", "SEEK_HOLE", "SEEK_DATA", "uname",
                        "nice", "openpty", "ttyname", "splice", "eventfd", "EFD_", "pidfd_",
                        "setuid", "seteuid", "chown", "lchown", "fchown", "getpriority",
                        "setpriority", "PRIO_"),
        "signal": lambda name: name not in _WINDOWS_SIGNAL_NAMES and not name.startswith("_"),
        "select": lambda name: name not in ("select", "error") and not name.startswith("_"),
        "mmap": lambda name: name not in _WINDOWS_MMAP_NAMES and not name.startswith("_"),
        "faulthandler": _prefixed("register", "unregister"),
        "socket": _prefixed("AF_UNIX", "CMSG_", "SCM_", "SO_PEERCRED", "sethostname",
                            "if_nameindex", "AF_NETLINK", "AF_PACKET"),
        "multiprocessing.reduction": _prefixed("DupFd", "sendfds", "recvfds"),
        "fcntl": None, "resource": None, "termios": None, "pwd": None, "grp": None,
        "posix": None, "pty": None, "tty": None, "_posixsubprocess": None, "_posixshmem": None,
        "libc": None,
        "platform": "win32",
    },
}


def _from_torchfeed(depth: int = 2) -> bool:
    """The caller ``depth`` frames up is torchfeed's own code."""
    try:
        name = sys._getframe(depth).f_globals.get("__name__") or ""
    except ValueError:
        return False
    return name == "torchfeed" or name.startswith("torchfeed.")


def _no_proc(path) -> bool:
    try:
        text = os.fsdecode(path)
    except TypeError:
        return False
    return text == "/proc" or text.startswith("/proc/")


class View(types.ModuleType):
    """A module as that host has it: ``lacks(name)`` names are missing,
    ``extra`` names replaced; everything else is the real module's."""

    def __init__(self, real, lacks, extra=None) -> None:
        super().__init__(real.__name__, getattr(real, "__doc__", None))
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_lacks", lacks)
        object.__setattr__(self, "_extra", extra or {})

    def __getattribute__(self, name):
        if name in ("_real", "_lacks", "_extra", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        extra = object.__getattribute__(self, "_extra")
        if name in extra:
            return extra[name]
        if object.__getattribute__(self, "_lacks")(name):
            raise AttributeError(f"module {self._real.__name__!r} has no attribute {name!r} "
                                 f"(simulated host: {PROFILE})")
        return getattr(object.__getattribute__(self, "_real"), name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)

    def __dir__(self):
        return [n for n in dir(self._real) if not self._lacks(n)] + list(self._extra)


class _LibcView:
    """``ctypes.CDLL(None)`` on macOS: libc without Linux's symbols."""

    def __init__(self, real, missing) -> None:
        self._real, self._missing = real, missing

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(f"dlsym(RTLD_DEFAULT, {name}): symbol not found "
                                 f"(simulated host: {PROFILE})")
        return getattr(self._real, name)


PROFILE: str | None = None
_views: dict[str, types.ModuleType] = {}


def _view(name: str, real):
    """torchfeed's view of module ``name`` (``real``), made once."""
    if name in _views:
        return _views[name]
    profile = PROFILES[PROFILE]
    lacks = profile.get(name, False)
    extra: dict = {}
    if name == "os":
        extra["path"] = _path_view(real.path)
        real_listdir, real_osopen = real.listdir, real.open

        def listdir(path="."):
            if _no_proc(path):
                raise FileNotFoundError(errno.ENOENT, f"No such file or directory (simulated "
                                                      f"host: {PROFILE})", path)
            return real_listdir(path)

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            if _no_proc(path):
                raise FileNotFoundError(errno.ENOENT, f"No such file or directory (simulated "
                                                      f"host: {PROFILE})", path)
            return real_osopen(path, flags, mode, dir_fd=dir_fd)

        extra.update(listdir=listdir, open=os_open)
        if PROFILE == "windows":
            extra.update(_windows_os(real))
    elif name == "sys":
        lacks = _prefixed("getdlopenflags", "setdlopenflags") if PROFILE == "windows" else False
        extra["platform"] = profile["platform"]
    elif name == "ctypes":
        extra["CDLL"] = _cdll(real.CDLL, profile["libc"])
        lacks = False
    elif name == "multiprocessing":
        extra["reduction"] = _view("multiprocessing.reduction", real.reduction)
        lacks = False
    if lacks is False:
        lacks = _nothing
    view = View(real, lacks, extra)
    _views[name] = view
    return view


def _nothing(name):
    return False


def _path_view(real_path):
    def guarded(function):
        return lambda path, *a, **k: False if _no_proc(path) else function(path, *a, **k)

    return View(real_path, _nothing, {"exists": guarded(real_path.exists),
                                      "isdir": guarded(real_path.isdir),
                                      "isfile": guarded(real_path.isfile)})


def _windows_os(real) -> dict:
    import signal as real_signal

    real_kill, real_read, real_write = real.kill, real.read, real.write

    def kill(pid, sig):
        # Windows: 0 and 1 are CTRL_C_EVENT and CTRL_BREAK_EVENT, a console
        # Ctrl-C; any other value ends the process (TerminateProcess).
        if sig in (0, 1):
            real_kill(pid, real_signal.SIGINT)
        else:
            real_kill(pid, real_signal.SIGKILL)

    def refuse_pipe(fd, what):
        try:
            is_pipe = stat.S_ISFIFO(real.fstat(fd).st_mode)
        except OSError:
            return
        if is_pipe:
            raise OSError(errno.EBADF, f"os.{what} on a pipe: on Windows multiprocessing's pipes "
                                       f"are handles, not file descriptors (simulated host)")

    def read(fd, n):
        refuse_pipe(fd, "read")
        return real_read(fd, n)

    def write(fd, data):
        refuse_pipe(fd, "write")
        return real_write(fd, data)

    return {"name": "nt", "kill": kill, "read": read, "write": write}


def _cdll(real_cdll, missing):
    def CDLL(name, *args, **kwargs):  # noqa: N802 - ctypes' name
        if name is None:
            if missing is None:  # Windows: CDLL needs a library's name
                raise TypeError("expected str, bytes or os.PathLike object, not NoneType "
                                f"(simulated host: {PROFILE})")
            return _LibcView(real_cdll(name, *args, **kwargs), set(missing))
        return real_cdll(name, *args, **kwargs)

    return CDLL


_PROXIED = {"os", "signal", "select", "mmap", "ctypes", "fcntl", "faulthandler", "socket",
            "sys", "resource", "termios", "pwd", "grp", "posix", "pty", "tty",
            "_posixsubprocess", "_posixshmem", "multiprocessing", "multiprocessing.reduction"}


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    """``builtins.__import__``: torchfeed's absolute imports get the host's views."""
    if level != 0 or not _is_torchfeed(globals):
        return _REAL_IMPORT(name, globals, locals, fromlist, level)
    profile = PROFILES[PROFILE]
    top = name.partition(".")[0]
    if profile.get(top, False) is None or profile.get(name, False) is None:
        raise ModuleNotFoundError(f"No module named {name!r} (simulated host: {PROFILE})",
                                  name=name)
    module = _REAL_IMPORT(name, globals, locals, fromlist, level)
    if fromlist:  # ``from name import x``: x is looked up on what is returned
        return _view(name, module) if name in _PROXIED else module
    return _view(top, module) if top in _PROXIED else module


def _is_torchfeed(globals) -> bool:
    name = (globals or {}).get("__name__") or ""
    return name == "torchfeed" or name.startswith("torchfeed.")


def _open(file, *args, **kwargs):
    if _no_proc(file) and _from_torchfeed():
        raise FileNotFoundError(errno.ENOENT, f"No such file or directory (simulated host: "
                                              f"{PROFILE})", file)
    return _REAL_OPEN(file, *args, **kwargs)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once module ``name`` has been imported."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then
        exec_module = loader.exec_module

        def exec_then(module):
            exec_module(module)
            then(module)

        loader.exec_module = exec_then
        return spec


def _file_system_sharing(module) -> None:
    module.set_sharing_strategy("file_system")  # torch's default on macOS and Windows


def _spawn_only() -> None:
    import multiprocessing
    import multiprocessing.context as context

    spawn = context._concrete_contexts["spawn"]
    context._concrete_contexts = {"spawn": spawn}
    context.DefaultContext.get_all_start_methods = lambda self: ["spawn"]
    multiprocessing.get_all_start_methods = context._default_context.get_all_start_methods
    context._default_context._default_context = spawn
    multiprocessing.set_start_method("spawn", force=True)


def install(profile: str) -> None:
    global PROFILE
    if profile not in PROFILES:
        raise SystemExit(f"TORCHFEED_HOST_PROFILE={profile!r}: use one of {', '.join(PROFILES)}")
    PROFILE = profile
    if profile == "windows":
        _spawn_only()
    else:
        import multiprocessing

        multiprocessing.set_start_method("spawn", force=True)  # macOS's default since 3.8
    sys.meta_path.insert(0, _AfterImport("torch.multiprocessing", _file_system_sharing))
    builtins.__import__ = _import
    builtins.open = _open
