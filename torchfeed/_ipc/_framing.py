"""The wire format of both queues: one codec for the writers and the reader.

A message is what ``multiprocessing.connection.Connection.send_bytes`` writes
and ``Queue.get`` reads back: a 4-byte big-endian signed length, then that
many bytes (a pickle).  A body over 2 GiB - 1 has a length of -1, then an
8-byte big-endian unsigned length.  ``frame`` writes the short form only: the
direct writers send nothing longer than ``PIPE_BUF``, and everything else goes
through the queue's feeder thread, which frames it itself.  The reader
(``MessageReader``) sees both forms, so ``message_span`` and ``bytes_to_come``
parse both.

The format is CPython's (``Connection._send_bytes``, identical in 3.10 to
3.13 as read in their sources): a worker still reads its index queue with
``Queue.get``, and the feeder threads still write with ``send_bytes``, so
changing it here means changing nothing else only as long as it stays theirs.
"""
from __future__ import annotations

import select
import struct

PIPE_BUF = getattr(select, "PIPE_BUF", 512)  # POSIX guarantees at least 512

_SHORT = struct.Struct("!i")  # the length; -1 means the 8-byte length follows
_LONG = struct.Struct("!Q")
_pack_length = _SHORT.pack
_unpack_short = _SHORT.unpack_from
_unpack_long = _LONG.unpack_from


def frame(body: bytes | memoryview) -> bytes:
    """``body`` as one message: its length, then the body (short form only)."""
    return _pack_length(len(body)) + body


def message_span(buf: bytearray, pos: int) -> tuple[int, int] | None:
    """(start, end) of the body of the message at ``buf[pos:]`` if all of it is
    in ``buf``, else None."""
    have = len(buf) - pos
    if have < 4:
        return None
    size, = _unpack_short(buf, pos)
    start = pos + 4
    if size == -1:
        if have < 12:
            return None
        size, = _unpack_long(buf, start)
        start += 8
    return (start, start + size) if len(buf) >= start + size else None


def bytes_to_come(buf: bytearray, pos: int) -> int:
    """How many bytes of the message at ``buf[pos:]`` are not yet in ``buf``
    (0 while its length is not known yet)."""
    have = len(buf) - pos
    if have < 12:
        return 0
    size, = _unpack_short(buf, pos)
    if size == -1:
        size, = _unpack_long(buf, pos + 4)
        return size + 12 - have
    return size + 4 - have
