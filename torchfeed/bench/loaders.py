"""The loaders the bench compares, and the optional packages behind some of them.

Owns each column's name, how its loader is built from a dataset and the
arguments every column shares (``batch_size``, ``num_workers``,
``collate_fn``), and why a column or a workload cannot run here:

- ``torch`` and ``torch@0``: ``torch.utils.data.DataLoader``, with the bench's
  ``num_workers`` and with none;
- ``torchfeed``: ``torchfeed.DataLoader``;
- the peers, the loaders users compare us with: ``torchdata`` (torchdata's
  ``StatefulDataLoader``) and ``spdl`` (SPDL's ``get_pytorch_dataloader``).
  They are optional: ``pip install 'torchfeed[bench]'`` installs them, and a
  missing one costs its column, with a one-line note, never the run;
- ``threads``: torchfeed with ``worker_method="thread"``, so that the
  ``torchfeed`` column's processes are compared with torchfeed's threads in
  the same table (``benchmarks/thread_workers.py`` has the full comparison).

A new column is one more entry in ``PEERS``.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch.utils.data

TORCH = "torch"
TORCHFEED = "torchfeed"
LOADERS = (TORCH, TORCHFEED)
# torch's DataLoader with num_workers=0: what turning workers on has to beat.
# On a small machine torch's workers lose to it on light workloads.
BASELINE = "torch@0"

TORCHDATA = "torchdata"
SPDL = "spdl"
THREADS = "threads"


def _torchdata(dataset, **kwargs):
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        # torchdata 0.11's constructor calls torch.set_vital, which torch 2.13
        # deprecates: the warning is about torchdata's source, not about the run.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, **kwargs)


def _threads(dataset, **kwargs):
    import torchfeed

    return torchfeed.DataLoader(dataset, worker_method="thread", **kwargs)


def _spdl(dataset, **kwargs):
    from spdl.dataloader import get_pytorch_dataloader

    # Its default hands batches over as they complete; in_order=True keeps the
    # sampler's order, so that its batches are the same as everyone else's.
    return get_pytorch_dataloader(dataset, in_order=True, **kwargs)


@dataclass(frozen=True)
class Peer:
    """A loader users compare us with, built only when its package imports."""

    name: str
    title: str
    module: str  # importing it is the test of "installed"
    pip: str
    build: Callable[..., Iterable]
    # Where it cannot take num_workers=0 (it would start a worker anyway).
    needs_workers: bool = False
    no_workers_note: str = "it has no num_workers=0 mode (it would start a worker process anyway)"
    # What the report should say whenever its column ran.
    caveat: str | None = None


PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer(TORCHDATA, "torchdata's StatefulDataLoader", "torchdata.stateful_dataloader",
         "torchdata", _torchdata),
    Peer(SPDL, "SPDL's get_pytorch_dataloader(in_order=True)", "spdl.dataloader", "spdl",
         _spdl, needs_workers=True,
         caveat="spdl copies the pickled dataset into a /dev/shm segment per loader and "
                "does not unlink it; Python's resource_tracker removes them when the bench "
                "exits, with a 'leaked shared_memory objects' warning"),
    Peer(THREADS, "torchfeed with worker_method='thread'", "torchfeed", "torchfeed", _threads,
         needs_workers=True, no_workers_note="with num_workers=0 it is the torchfeed column",
         caveat="threads' workers are threads of the consuming process: its main CPU and peak "
                "MiB hold their loading and their batches, which for the others are the workers'"),
]}


def import_problem(module: str) -> str | None:
    """None when ``module`` imports; else why not, in a few words."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] == top:
            return f"{top} is not installed"
        return f"importing {module} failed: {exc}"
    except Exception as exc:  # a package that is there but broken (a binary mismatch)
        return f"importing {module} failed: {type(exc).__name__}: {exc}"
    return None


def peer_note(name: str, num_workers: int) -> str | None:
    """The one line that says why peer ``name``'s column is skipped, or None when it runs."""
    peer = PEERS[name]
    problem = import_problem(peer.module)
    if problem is not None:
        return (f"{name}: column skipped, {problem} "
                f"(pip install {peer.pip}, or pip install 'torchfeed[bench]')")
    if peer.needs_workers and num_workers == 0:
        return f"{name}: column skipped, {peer.no_workers_note}"
    return None


def loader_class(name: str) -> Callable[..., Any]:
    """The class behind a torch or torchfeed column."""
    if name in (TORCH, BASELINE):
        return torch.utils.data.DataLoader
    if name == TORCHFEED:
        import torchfeed  # late: a broken torchfeed must not stop torch's rows

        return torchfeed.DataLoader
    raise ValueError(f"unknown loader {name!r}")


def build_loader(name: str, dataset, kwargs: dict[str, Any]) -> Iterable:
    """Column ``name``'s loader over ``dataset`` with ``kwargs``."""
    if name in PEERS:
        return PEERS[name].build(dataset, **kwargs)
    return loader_class(name)(dataset, **kwargs)
