"""libc through ctypes, for the mappings that hold no descriptor: the slots'
arenas (``_transport/_arena.py``) and the shared containers' packs
(``_share/_buffer.py``).

Loaded on first use, with the prototypes both use, and never at import:
Windows has no ``CDLL(None)``, and macOS's libc no ``fallocate``.  Only a
host with the slots (``_host.SHM_SLOTS``) or shared containers
(``_host.SHARED_CONTAINERS``) calls it.
"""
from __future__ import annotations

import ctypes

from . import _host

MAP_FAILED = ctypes.c_void_p(-1).value
_loaded: list = []  # [libc], once loaded


def libc():
    """The process's libc, with ``mmap``, ``munmap``, ``mprotect``, ``madvise``
    and (where it exists) ``fallocate`` typed."""
    if not _loaded:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if _host.HAS_FALLOCATE:
            lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _loaded.append(lib)
    return _loaded[0]
