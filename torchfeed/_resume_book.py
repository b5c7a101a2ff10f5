"""Per-loader resume book-keeping: which epoch starts next, and a loaded state's plan for it.

``ResumeBook`` lives on the loader: the ``IndexStream`` (``_index_stream.py``) of
the latest epoch started, the epoch count, and a state that ``load_state_dict``
loaded (a ``Checkpoint``, ``_checkpoint.py``) with the ``Plan`` the next ``iter()``
follows.  ``_state.py`` writes the plan; the iterators' index stream takes it
when an epoch starts.  Nothing here reads a state dict.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.data import IterableDataset

from ._checkpoint import KIND, VERSION, Checkpoint
from ._iterable_shards import rank_and_world_size
from ._sampler_state import describe_sampler
from ._streaming_adapters import adapter_for

if TYPE_CHECKING:
    from ._index_stream import IndexStream


class Plan:
    """What the next epoch started on a loader is: its number, and what to restore."""

    __slots__ = ("epoch", "checkpoint", "base_seed", "worker_states", "exhausted_workers",
                 "global_rng", "host_rng", "next", "iterator_states", "ended_iterator_states")

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def __init__(self, epoch: int, checkpoint: Checkpoint | None = None, base_seed=None,
                 worker_states=None,
                 exhausted_workers=(), global_rng=None, host_rng=None, next=None,
                 iterator_states=None, ended_iterator_states=None) -> None:
        self.epoch = epoch
        self.checkpoint = checkpoint        # a state whose epoch this one continues
        self.base_seed = base_seed          # persistent workers keep one base seed
        self.worker_states = worker_states  # dataset states to load first
        self.iterator_states = iterator_states  # loaded into what iter(dataset) returns
        # persistent workers after a finished epoch: what its iterators ended with
        self.ended_iterator_states = ended_iterator_states
        self.exhausted_workers = exhausted_workers  # workers with nothing left this epoch
        self.global_rng = global_rng        # a new epoch's draws come from this global RNG
        self.host_rng = host_rng            # and from these numpy / Python global RNGs
        # A state with every batch yielded, for a sampler with set_epoch: the plan
        # for the next epoch, taken if the sampler was set to another epoch since.
        self.next = next


_LEN_UNKNOWN = object()  # len(dataset) not asked for yet


class ResumeBook:
    """Per-loader book-keeping: the live index stream, the epoch count, a loaded state."""

    undo_start = None  # set while an iter() is starting an epoch (see starting())

    def __init__(self, loader) -> None:
        self.live: IndexStream | None = None  # the IndexStream of the latest epoch started
        self.next_epoch = 0
        self.plan: Plan | None = None  # set by load_state_dict, used by the next iter()
        self.loaded: Checkpoint | None = None  # the state loaded; state_dict() until iter()
        self.warned = False   # state_dict() said once why a resume cannot be exact
        dataset = loader.dataset
        self.adapter = adapter_for(dataset)  # mosaicml-streaming's, litdata's dataset
        iterable = isinstance(dataset, IterableDataset)
        # len(dataset) waits until a state is saved or loaded (see header):
        # torch's iter() calls it only through a sampler that needs it.
        self._dataset = None if iterable else dataset
        self._header = {
            "version": VERSION, "kind": KIND,
            "dataset_kind": "iterable" if iterable else "map", "dataset_len": _LEN_UNKNOWN,
            "batch_size": loader.batch_size, "drop_last": bool(loader.drop_last),
            "num_workers": loader.num_workers,
            "persistent_workers": bool(loader.persistent_workers),
            # an IterableDataset's per-rank stream only resumes at this world size
            "world_size": rank_and_world_size()[1] if iterable else None,
            "sampler": None if iterable else describe_sampler(loader._index_sampler),
        }

    @property
    def header(self) -> dict:
        if self._header["dataset_len"] is _LEN_UNKNOWN:
            try:
                length = None if self._dataset is None else len(self._dataset)
            except (TypeError, NotImplementedError):  # no usable __len__: torch's
                length = None                         # batch_sampler path works without
            self._header["dataset_len"] = length
            self._dataset = None
        return self._header

    def __getstate__(self):
        # A copied or pickled loader keeps its epoch count and a pending loaded
        # state, not the live iteration (whose sampler iterator cannot be copied):
        # like torch's loader, the copy's next iter() starts an epoch.
        return {"live": None, "next_epoch": self.next_epoch, "plan": self.plan,
                "loaded": self.loaded, "_header": self.header, "_dataset": None,
                "warned": self.warned, "adapter": self.adapter}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    @staticmethod
    def of(loader) -> "ResumeBook":
        book = loader.__dict__.get("_resume_book")
        if book is None:
            book = loader.__dict__["_resume_book"] = ResumeBook(loader)
        return book

    def undo_point(self):
        """What ``begin`` changes, to put back if the epoch then fails to start."""
        saved = (self.plan, self.loaded, self.live, self.next_epoch)

        def undo() -> None:
            self.plan, self.loaded, self.live, self.next_epoch = saved
        return undo

    def begin(self, stream, plan: Plan | None = None) -> Plan:
        """Start the epoch ``plan`` says (default: the pending one, else the next)."""
        if plan is None:
            plan = self.plan if self.plan is not None else Plan(self.next_epoch)
        self.plan = self.loaded = None
        self.live = stream
        self.next_epoch = plan.epoch + 1
        return plan


