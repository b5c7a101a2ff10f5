"""Helpers for tests/test_transport.py: batch makers, a worker loop, a small
consumer pipeline and probes for leftover shared memory.

A module of its own so that spawned and forkserver workers can import it.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import gc
import os
import queue
import time

import numpy as np
import torch

from torchfeed._transport import create_channel

MEMFD_TAG = "torchfeed-transport"

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Record:
    image: torch.Tensor
    name: str
    extra: object = None


class FrozenMap(collections.abc.Mapping):
    """A read-only Mapping type, to check custom Mappings survive."""

    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Seq(collections.abc.Sequence):
    """An immutable custom Sequence type."""

    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)


class Holder:
    """An arbitrary object with a tensor attribute."""

    def __init__(self, t, label):
        self.t = t
        self.label = label


TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex32, torch.complex64,
                torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16,
                np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                np.complex128, "datetime64[ns]", ">f8",
                [("id", "<i8"), ("xy", "<f4", (2,)), ("ok", "?")]]


def _torch_leaf(dtype, i):
    g = torch.Generator().manual_seed(i)
    base = torch.randn(3, 5, generator=g, dtype=torch.float64) * 4
    if dtype is torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def _numpy_leaf(dtype, i):
    rng = np.random.default_rng(i)
    dt = np.dtype(dtype)
    if dt.fields is not None:
        a = np.zeros(4, dt)
        a["id"] = np.arange(4) + i
        a["xy"] = rng.standard_normal((4, 2))
        a["ok"] = [True, False, True, i % 2 == 0]
        return a
    if dt.kind == "M":  # a bare int added to datetimes is deprecated from numpy 2.5
        return np.arange(6).astype(dt).reshape(2, 3) + np.timedelta64(i, np.datetime_data(dt)[0])
    if dt.kind == "b":
        return rng.standard_normal((2, 3)) > 0
    if dt.kind == "c":
        return (rng.standard_normal((2, 3)) + 1j * rng.standard_normal((2, 3))).astype(dt)
    return (rng.standard_normal((2, 3)) * 10).astype(dt)


def every_leaf(i):
    """A batch with every leaf type and nesting the transport promises to keep."""
    g = torch.Generator().manual_seed(1000 + i)
    big = torch.randn(6, 8, generator=g)
    # Numpy arrays of their own: torch's reductions move a storage into shared
    # memory when they send it, which would leave numpy views of it dangling.
    nbig = np.random.default_rng(i).standard_normal((6, 8))
    shared = torch.arange(5) * i
    return {
        "torch": {str(d): _torch_leaf(d, i) for d in TORCH_DTYPES},
        "numpy": [_numpy_leaf(d, i) for d in NUMPY_DTYPES],
        "noncontig": (big.t(), big[::2, 1::3], torch.arange(4.0).expand(3, 4),
                      torch.complex(big, big).conj(),
                      np.asfortranarray(nbig), nbig[::-1, ::2]),
        "zero_dim": (torch.tensor(3.5 + i), np.array(7 + i)),
        "empty": (torch.empty(0, 3), np.empty((2, 0), np.int16),
                  torch.empty(0, dtype=torch.bfloat16)),
        "point": Point(torch.full((2,), i), "p"),
        "record": Record(torch.ones(2, 2) * i, f"rec{i}", extra={"k": [1, 2]}),
        "frozen": FrozenMap({"a": torch.tensor([i]), "b": "bee"}),
        "seq": Seq([torch.tensor([1, i]), "s"]),
        "ordered": collections.OrderedDict([("z", np.arange(3)), ("a", 1)]),
        "holder": Holder(torch.arange(3) + i, "h"),
        "same_twice": [shared, shared],
        "plain": ("text", 42 + i, 2.5, None, b"bytes", [1, (2, 3)], {"nested": {"deep": i}}),
        "special": (torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)),
                    torch.nn.Parameter(torch.ones(2) * i),
                    torch.ones(2, requires_grad=True),
                    np.array(["a", "bc"], dtype=object)),
        "index": i,
    }


def image_batch(i, n=4, size=32):
    return (torch.full((n, 3, size, size), i % 251, dtype=torch.uint8),
            torch.arange(n) + i)


def sized_batch(i, n=1):
    """``n`` * 64 KiB of float32 plus a marker."""
    return {"data": torch.full((n * 16384,), float(i)), "i": i}


def big_batch(i, mib=8):
    return torch.full((mib << 18,), float(i))


MAKERS = {"every_leaf": every_leaf, "image": image_batch, "sized": sized_batch,
          "big": big_batch}


def samples_for(i, n=8, side=4):
    """Samples for default_collate: a tuple of a tensor, numpy array, float, int, str, dict."""
    return [(torch.full((3, side), float(i * n + j)), np.arange(2, dtype=np.int32) + j,
             0.5 * j, j, f"s{j}", {"p": Point(torch.tensor([j]), np.float32(j))})
            for j in range(n)]


def two_tensor_samples(i, n=8, side=1 << 13, extra=1):
    """Samples whose second tensor can outgrow the slot the first was stacked into."""
    return [(torch.full((3, side), float(i * n + j)), torch.full((extra,), float(j)))
            for j in range(n)]


SAMPLERS = {"collate": samples_for, "collate2": two_tensor_samples}


def worker_loop(channel, worker_id, task_q, result_q, direct=False, as_torch_worker=False):
    """Fetch tasks ``(i, maker, kwargs)``, send ``(i, payload)``; exit on None or orphaning."""
    parent = os.getppid()
    torch.set_num_threads(1)
    if as_torch_worker:
        from torch.utils.data._utils import worker as tw
        tw._worker_info = tw.WorkerInfo(id=worker_id, num_workers=1, seed=0, dataset=None)
    packer = channel.packer(worker_id)
    while True:
        try:
            task = task_q.get(timeout=0.1)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        i, maker, kwargs = task
        if maker in SAMPLERS:
            samples = SAMPLERS[maker](i, **kwargs)
            if direct:
                payload = packer.pack(packer.collate(samples))
            else:
                from torch.utils.data import default_collate
                payload = packer.pack(default_collate(samples))
        else:
            payload = packer.pack(MAKERS[maker](i, **kwargs))
        result_q.put((i, payload))


class Pipeline:
    """Workers plus the main-process end, as the loader will drive them."""

    def __init__(self, num_workers=1, method="fork", options=None, direct=False,
                 as_torch_worker=False):
        import multiprocessing as mp
        self.ctx = mp.get_context(method)
        self.channel = create_channel(num_workers, self.ctx, options)
        self.unpacker = self.channel.unpacker()
        self.task_qs = [self.ctx.Queue() for _ in range(num_workers)]
        self.result_q = self.ctx.Queue()
        self.procs = [self.ctx.Process(target=worker_loop,
                                       args=(self.channel, w, self.task_qs[w], self.result_q,
                                             direct, as_torch_worker), daemon=True)
                      for w in range(num_workers)]
        for p in self.procs:
            p.start()
        self.n = 0

    def get(self, maker="image", timeout=30, **kwargs):
        """Ask worker ``n % num_workers`` for batch ``n`` and return ``(n, batch)``."""
        i = self.n
        self.n += 1
        self.task_qs[i % len(self.task_qs)].put((i, maker, kwargs))
        j, payload = self.result_q.get(timeout=timeout)
        assert j == i
        return i, self.unpacker.unpack(payload)

    def get_payload(self, maker="image", timeout=30, **kwargs):
        i = self.n
        self.n += 1
        self.task_qs[i % len(self.task_qs)].put((i, maker, kwargs))
        return self.result_q.get(timeout=timeout)[1]

    def close(self):
        for q in self.task_qs:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.unpacker.close()
        for q in self.task_qs + [self.result_q]:
            q.close()
            q.join_thread()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- probes -----------------------------------------------------------------

def dev_shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def memfd_refs(pid):
    """Descriptors and mappings of torchfeed arenas held by process ``pid``."""
    refs = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if MEMFD_TAG in target:
                refs.append(("fd", fd, target))
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if MEMFD_TAG in line:
                    refs.append(("map", line.strip()))
    except (FileNotFoundError, ProcessLookupError):
        return []
    return refs


def memfd_refs_now() -> set:
    """This process's torchfeed arena references, once the collector has run:
    what earlier tests in this pytest worker may still hold (a batch kept by a
    fixture, or by garbage the collector had not reached).  A test checks that
    it leaves none of its own: ``added_memfd_refs(before)``."""
    gc.collect()
    return set(memfd_refs(os.getpid()))


def added_memfd_refs(before: set) -> list:
    """This process's torchfeed arena references that ``before`` did not have."""
    return sorted(set(memfd_refs(os.getpid())) - before)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def shm_entries_of(pids):
    """/dev/shm entries that processes ``pids`` have mapped right now."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        names.add(line.split("/dev/shm/", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return names


def leftover_shm(before, pids, used=(), timeout=15.0):
    """Entries in /dev/shm that these processes made and left behind.

    The machine's /dev/shm is shared with other sessions, so an entry counts
    only if it can be ours: named after torchfeed, a torch segment named after
    one of ``pids``, or one ``used`` (mapped by our processes while they ran).
    Python's resource tracker removes a killed program's semaphores a moment
    after its last process exits; ``timeout`` leaves it that moment.
    """
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    used = set(used)

    def ours():
        return {n for n in dev_shm() - before
                if "torchfeed" in n or n.startswith(prefixes)} | (used & dev_shm())

    wait_until(lambda: not ours(), timeout)
    return ours()


def sigkill_main_process(script: str, workers: int = 2, env: dict | None = None):
    """Run ``script`` (it prints its workers' pids on one line once they hold
    their slots: the first ``workers`` of them hold slots, any after them are
    workers of another kind) as a main process, with ``env`` added to its
    environment, SIGKILL it, and return ``(pids, shm_before, used)`` for the
    leftover checks: every pid, workers and main."""
    import subprocess
    import sys

    before = dev_shm()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) >= workers
        assert all(memfd_refs(pid) for pid in pids[:workers])
        used = shm_entries_of(pids + [proc.pid])
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    return pids + [proc.pid], before, used
