"""``import torchfeed`` works wherever torch imports: no name that only some hosts
have is used while any torchfeed module is imported (issue 51).

macOS has no ``os.memfd_create``, ``mmap.MADV_REMOVE`` or libc ``fallocate``;
Windows has no ``fcntl``, ``resource``, ``os.register_at_fork``, ``select.poll``,
``signal.SIGKILL``, ``ctypes.CDLL(None)``...  A module that touches one of them
when it is imported makes ``import torchfeed`` fail there.  This walks the AST
of every module of the package and finds each such use in what runs at import:

- module-level statements, and the bodies of ``if``, ``for``, ``while``,
  ``with`` and ``try`` at that level;
- class bodies, base classes and class keywords;
- decorators, default arguments (and annotations, where a module evaluates them);
- the bodies of the module's own functions and classes that those call
  (``_libc = _load()``, ``releaser = Releaser()``, ``@local_decorator``).

A use is guarded, and allowed, under ``if`` on ``torchfeed._host``'s flags,
``hasattr``, ``sys.platform`` or ``os.name``, and in a ``try`` whose handlers
catch ``ImportError``, ``AttributeError``, ``OSError`` or ``Exception``.
``getattr(module, "name", default)`` is how to look a name up; without a
default it counts as a use.  Function bodies run later, on the host's say-so
(``if not _host.SHM_SLOTS: raise ...``): the host profiles' runs check those
(``tests/host_profiles``).
"""
from __future__ import annotations

import ast
import pathlib

import torchfeed

PACKAGE = pathlib.Path(torchfeed.__file__).parent

# Modules that some host where torch runs does not have.
HOST_ONLY_MODULES = {"fcntl", "resource", "termios", "pwd", "grp", "posix", "pty", "tty",
                     "_posixsubprocess", "_posixshmem", "msvcrt", "winreg", "_winapi",
                     "_overlapped", "nt"}
# Per module: the names every host has (an allowlist), or the names some host lacks.
EVERYWHERE = {
    "signal": {"SIGINT", "SIGTERM", "SIGABRT", "SIGFPE", "SIGILL", "SIGSEGV", "SIG_DFL",
               "SIG_IGN", "NSIG", "signal", "getsignal", "default_int_handler", "Signals",
               "Handlers", "strsignal", "raise_signal", "valid_signals", "set_wakeup_fd"},
    "mmap": {"mmap", "PAGESIZE", "ALLOCATIONGRANULARITY", "ACCESS_READ", "ACCESS_WRITE",
             "ACCESS_COPY", "ACCESS_DEFAULT", "error"},
    "select": {"select", "error"},
}
SOMEWHERE = {
    "os": {"memfd_create", "MFD_*", "register_at_fork", "posix_fallocate", "posix_fadvise",
           "pwrite", "pread", "pwritev", "preadv", "set_blocking", "get_blocking", "fork",
           "forkpty", "sched_*", "getloadavg", "statvfs", "fstatvfs", "O_CLOEXEC",
           "O_NONBLOCK", "killpg", "getpgid", "setsid", "setpgrp", "WNOHANG", "wait3",
           "wait4", "getuid", "geteuid", "getgid", "sysconf", "pipe2", "splice",
           "eventfd", "pidfd_open", "sendfile", "mkfifo", "sync", "F_*", "POSIX_*",
           "RWF_*", "SEEK_HOLE", "SEEK_DATA", "startfile"},
    "multiprocessing.reduction": {"DupFd", "sendfds", "recvfds", "DupHandle", "steal_handle",
                                  "duplicate", "send_handle", "recv_handle"},
    "socket": {"AF_UNIX", "CMSG_*", "SCM_RIGHTS", "SO_PEERCRED", "sethostname"},
    "ctypes": {"WinDLL", "windll", "oledll", "OleDLL", "WINFUNCTYPE", "FormatError",
               "GetLastError", "get_last_error", "set_last_error"},
    "sys": {"getwindowsversion", "winver", "getdlopenflags", "setdlopenflags"},
    "faulthandler": {"register", "unregister"},
}
# Calls that load a native library: each host names its libraries differently
# (``CDLL(None)`` is a TypeError on Windows).
LIBRARY_LOADS = {"ctypes.CDLL", "ctypes.cdll.LoadLibrary", "ctypes.PyDLL",
                 "ctypes.util.find_library", "ctypes.WinDLL"}
GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "OSError",
                    "Exception", "TypeError", "BaseException"}


def host_only(module: str, name: str) -> bool:
    """Whether ``module.name`` is missing on some host where torch runs."""
    if module in HOST_ONLY_MODULES:
        return True
    if module in EVERYWHERE:
        return name not in EVERYWHERE[module] and not name.startswith("_")
    for pattern in SOMEWHERE.get(module, ()):
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return False


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_guard(test) -> bool:
    """A condition on what the host has: it says when the body may run."""
    text = ast.unparse(test)
    return ("_host." in text or text.startswith("_host") or "hasattr(" in text
            or "sys.platform" in text or "os.name" in text or "TYPE_CHECKING" in text)


def _catches_absence(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((_dotted(t) or "").rsplit(".", 1)[-1] in GUARD_EXCEPTIONS for t in types)


class ImportTimeUses:
    """The host-only names a module's source uses when it is imported."""

    def __init__(self, source: str, filename: str = "<module>") -> None:
        self.tree = ast.parse(source, filename)
        self.filename = filename
        self.aliases: dict[str, str] = {}  # local name -> the module it is
        self.functions: dict[str, ast.AST] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.lazy_annotations = False
        for node in self.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                self.lazy_annotations |= any(a.name == "annotations" for a in node.names)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
        for node in ast.walk(self.tree):  # every binding of a module, wherever it is
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        self.found: list[str] = []
        self._visited: set[str] = set()
        self._statements(self.tree.body)

    # -- what runs ---------------------------------------------------------------
    def _statements(self, body) -> None:
        for statement in body:
            self._statement(statement)

    def _statement(self, node) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._signature(node)
        elif isinstance(node, ast.ClassDef):
            self._decorators(node)
            for part in [*node.bases, *(k.value for k in node.keywords)]:
                self._expression(part)
            self._statements(node.body)
        elif isinstance(node, ast.If):
            self._expression(node.test)
            negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
            if _is_guard(node.test):
                self._statements(node.body if negated else node.orelse)
            else:
                self._statements(node.body)
                self._statements(node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            if not any(_catches_absence(h) for h in node.handlers):
                self._statements(node.body)
            for handler in node.handlers:
                self._statements(handler.body)
            self._statements(node.orelse)
            self._statements(node.finalbody)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self._import(node)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    self._statement(child)
                else:
                    self._expression(child)

    def _decorators(self, node) -> None:
        for decorator in node.decorator_list:
            self._expression(decorator)
            if isinstance(decorator, ast.Name):  # @local_function calls it now
                self._run_local(decorator.id)

    def _signature(self, node) -> None:
        self._decorators(node)
        args = node.args
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self._expression(default)
        if not self.lazy_annotations:
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    self._expression(arg.annotation)
            if node.returns is not None:
                self._expression(node.returns)

    def _expression(self, node) -> None:
        if node is None:
            return
        if isinstance(node, ast.Lambda):
            for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]:
                self._expression(default)
            return  # the body runs when called
        if isinstance(node, ast.Attribute):
            self._attribute(node)
        elif isinstance(node, ast.Call):
            self._call(node)
        for child in ast.iter_child_nodes(node):
            self._expression(child)

    # -- what counts -------------------------------------------------------------
    def _report(self, node, what: str) -> None:
        self.found.append(f"{self.filename}:{node.lineno}: {what}")

    def _import(self, node) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in HOST_ONLY_MODULES:
                    self._report(node, f"import {alias.name}")
        elif node.level == 0 and node.module:
            if node.module.split(".")[0] in HOST_ONLY_MODULES:
                self._report(node, f"from {node.module} import ...")
            for alias in node.names:
                if host_only(node.module, alias.name):
                    self._report(node, f"from {node.module} import {alias.name}")

    def _attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is None:
            return
        head, _, rest = dotted.partition(".")
        module = self.aliases.get(head)
        if module is None or not rest:
            return
        parts = rest.split(".")
        # the deepest module the chain names: os.path.x is os.path's x
        for i in range(len(parts), 0, -1):
            owner = ".".join([module, *parts[:i - 1]])
            if host_only(owner, parts[i - 1]):
                self._report(node, f"{owner}.{parts[i - 1]} (as {dotted})")
                return

    def _call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        if name is None:
            return
        head, _, rest = name.partition(".")
        resolved = f"{self.aliases.get(head, head)}{'.' + rest if rest else ''}"
        if resolved in LIBRARY_LOADS:
            self._report(node, f"{resolved}(...) loads a native library")
        if (resolved == "getattr" and len(node.args) == 2
                and isinstance(node.args[1], ast.Constant)):
            module = self.aliases.get(_dotted(node.args[0]) or "")
            if module is not None and host_only(module, str(node.args[1].value)):
                self._report(node, f"getattr({module}, {node.args[1].value!r}) without a default")
        if not rest:
            self._run_local(name)

    def _run_local(self, name: str) -> None:
        """The module's own function or class ``name`` is called now: its code runs."""
        if name in self._visited:
            return
        if name in self.functions:
            self._visited.add(name)
            self._statements(self.functions[name].body)
        elif name in self.classes:
            self._visited.add(name)
            for item in self.classes[name].body:
                if isinstance(item, ast.FunctionDef) and item.name in (
                        "__init__", "__new__", "__post_init__", "__init_subclass__"):
                    self._statements(item.body)


def uses_at_import(source: str, filename: str = "<module>") -> list[str]:
    return ImportTimeUses(source, filename).found


def test_no_host_only_name_used_at_import():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += uses_at_import(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, ("host-only names used while torchfeed is imported; guard them with a "
                       "torchfeed._host flag or use them inside functions:\n" + "\n".join(found))


def test_the_walk_sees_every_kind_of_import_time_use():
    """Each snippet uses a host-only name at import (the issue's own list among
    them): the walk must name it, or the test above proves nothing."""
    cases = {
        "import fcntl": "import fcntl",
        "import resource as r": "import resource",
        "from fcntl import F_ADD_SEALS": "from fcntl import",
        "import os\nf = os.memfd_create": "os.memfd_create",
        "from os import register_at_fork": "from os import register_at_fork",
        "import os\nos.register_at_fork(after_in_child=print)": "os.register_at_fork",
        "import signal\nHINTS = {signal.SIGKILL: 'oom'}": "signal.SIGKILL",
        "import signal as s\nclass A:\n    SIG = s.SIGBUS": "signal.SIGBUS",
        "import signal\nDUMP = signal.SIGUSR1": "signal.SIGUSR1",
        "import mmap\ndef remove(start=0, _r=mmap.MADV_REMOVE):\n    pass": "mmap.MADV_REMOVE",
        "import select\ndef deco(f):\n    select.poll()\n    return f\n@deco\ndef g():\n    pass":
            "select.poll",
        "import ctypes\n_libc = ctypes.CDLL(None)": "ctypes.CDLL",
        "import ctypes\ndef load():\n    return ctypes.CDLL(None)\n_libc = load()": "ctypes.CDLL",
        "import os\nclass R:\n    def __init__(self):\n        os.register_at_fork(after_in_child=print)\n"
        "releaser = R()": "os.register_at_fork",
        "import os\nif True:\n    X = os.posix_fallocate": "os.posix_fallocate",
        "import os\nX = getattr(os, 'memfd_create')": "getattr(os, 'memfd_create')",
        "from multiprocessing import reduction\nR = reduction.DupFd": "multiprocessing.reduction.DupFd",
        "import os\nSIZES = [os.sched_getaffinity(0) for _ in range(2)]": "os.sched_getaffinity",
        "import mmap\ntry:\n    pass\nfinally:\n    F = mmap.MAP_SHARED": "mmap.MAP_SHARED",
    }
    for source, expected in cases.items():
        found = uses_at_import(source)
        assert any(expected in line for line in found), f"not found in {source!r}: {found}"


def test_the_walk_leaves_guarded_and_deferred_uses_alone():
    """Uses that do not run at import, or run only where the host has the name."""
    allowed = [
        "import os\ndef f():\n    return os.memfd_create('x')",
        "import os\nf = lambda: os.memfd_create('x')",
        "from torchfeed import _host\nimport os\nif _host.HAS_MEMFD:\n    f = os.memfd_create",
        "from torchfeed import _host\nimport signal\nif not _host.HAS_POSIX_SIGNALS:\n    pass\n"
        "else:\n    K = signal.SIGKILL",
        "try:\n    import fcntl\nexcept ImportError:\n    fcntl = None",
        "import os\nif hasattr(os, 'register_at_fork'):\n    os.register_at_fork(after_in_child=print)",
        "import signal\nHINT = {getattr(signal, n): n for n in ('SIGKILL',) if hasattr(signal, n)}",
        "import os\nX = getattr(os, 'memfd_create', None)",
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)",
        "import mmap\nPAGE = mmap.PAGESIZE",
        "import select\nPIPE_BUF = getattr(select, 'PIPE_BUF', 512)",
    ]
    for source in allowed:
        assert uses_at_import(source) == [], source
