"""A round trip through ``torchfeed/_ipc`` under any CPython, without torch.

``python tests/ipc_roundtrip.py REPO_ROOT`` loads ``_ipc`` and ``_host`` by
their path, as modules of a ``torchfeed`` package whose ``__init__`` (which
imports torch) never runs: both import only the standard library, so this
runs under interpreters that have no torch; this is how ``_ipc/_mp_queue.py``'s
list of checked Python versions was run.  For each backend (the fd one, and
the portable one, ``TORCHFEED_PORTABLE=1``) and each start method, one worker
process reads its index queue (``Queue.get``, as the real worker) and answers
through ``ResultWriter``; the main side writes through ``IndexQueue`` and
reads through ``result_reader`` (``MessageReader``, ``RelayReader``).
Both directions cross from direct writes to the feeder thread mid-stream (a
task, then a result, bigger than ``PIPE_BUF``), so messages of both writers and
of both feeders must arrive whole and in order, and each queue's size
semaphore must end full: every unit a write took, a read gave back (the reader
would have raised had it given back one more).
"""
import multiprocessing as mp
import os
import pickle
import sys
import types

if "torchfeed" not in sys.modules:  # a package whose __init__ (torch) is never run
    _package = types.ModuleType("torchfeed")
    _package.__path__ = [os.path.join(os.path.abspath(sys.argv[1]), "torchfeed")]
    sys.modules["torchfeed"] = _package
from torchfeed import _host, _ipc  # noqa: E402
from torchfeed._ipc._framing import PIPE_BUF  # noqa: E402
from torchfeed._ipc._mp_queue import size_semaphore  # noqa: E402


def worker(index_q, result_q):
    _ipc.become_write_only(result_q)
    writer = _ipc.ResultWriter(result_q)
    ready = _ipc.reader_ready(index_q)
    while True:
        if not ready(0.25):
            continue
        task = index_q.get()
        if task is None:
            break
        if isinstance(task, list):  # the big task, which came through the feeder
            task = len(task)
        writer.put((task, b"x" * task))  # a body over PIPE_BUF moves to the feeder
    result_q.close()
    result_q.join_thread()


def round_trip(method: str) -> None:
    ctx = mp.get_context(method)
    result_q = ctx.Queue()
    index_q = _ipc.IndexQueue(ctx)
    process = ctx.Process(target=worker, args=(index_q.queue, result_q), daemon=True)
    process.start()
    reader = _ipc.result_reader(result_q)
    assert isinstance(reader, _ipc.MessageReader if _host.fd_backend() else _ipc.RelayReader)
    sizes = [10, 100, 2 * PIPE_BUF, 20, 50 * PIPE_BUF, 3]
    for n in sizes:
        index_q.put(n)
    big = list(range(2 * PIPE_BUF))
    index_q.put(big)
    index_q.put(7)
    expected = [*sizes, len(big), 7]
    for n in expected:
        while not reader.started():
            _ipc.wait_ready([reader.fd], 0.1)
        task, body = pickle.loads(reader.read({process.sentinel: 0}, lambda: False))
        assert task == n and len(body) == n, (method, n, task, len(body))
    index_q.put(None)
    process.join(30)
    assert process.exitcode == 0, (method, process.exitcode)
    lock = _ipc.write_lock(result_q)
    if lock is not None:  # Windows has none
        assert lock.acquire(timeout=1), "a writer left the result queue's write lock taken"
        lock.release()
    index_q.close()
    _ipc.close_queue(result_q)
    for q in (result_q, index_q.queue):
        try:  # every unit a writer took was given back by a read: the bound is full
            size_semaphore(q).release()
        except ValueError:
            continue
        raise AssertionError(f"{method}: a message's unit of the size semaphore never came back")


if __name__ == "__main__":
    for portable in ("0", "1"):
        os.environ[_host.PORTABLE_ENV] = portable  # the workers inherit it
        for method in mp.get_all_start_methods():
            round_trip(method)
    print(f"{sys.version.split()[0]}: round trip ok")
