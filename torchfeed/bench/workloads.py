"""The built-in workloads of ``python -m torchfeed.bench``.

Owns the synthetic datasets that stand in for real training data, and the
table of every workload (these and the real pipelines of
:mod:`~torchfeed.bench.pipelines`) with its batch size, ``collate_fn``, run
length and the optional modules it needs.  Every dataset is map-style, deterministic (same
index, same sample, in any process), built in code from a seeded generator
with nothing downloaded, and picklable, so it works under fork, spawn and
forkserver alike.

Samples are copied out of a small pool built once in ``__init__``: a real
dataset decodes into fresh memory for every sample, and the copy models that
without making generation itself the bottleneck being measured.

The module-level factories (``small()``, ``image()``, ...) take no arguments,
so they double as ``module:factory`` targets for the tuner, for example
``python -m torchfeed.tune torchfeed.bench.workloads:cpu_heavy --batch-size 16``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from . import pipelines
from .loaders import import_problem

# Long enough for any tuner run; the bench sizes its datasets to the run.
_DEFAULT_LENGTH = 1 << 20


class _PooledDataset(Dataset):
    """Shared plumbing: a fixed length and torch-style IndexError past the end."""

    def __init__(self, length: int) -> None:
        self.length = int(length)

    def __len__(self) -> int:
        return self.length

    def _check(self, index: int) -> int:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {type(self).__name__} "
                             f"of length {self.length}")
        return index


class SmallDataset(_PooledDataset):
    """A 16-float feature vector and an int label: the tabular/small-model case."""

    def __init__(self, length: int = _DEFAULT_LENGTH, pool: int = 1024, seed: int = 0) -> None:
        super().__init__(length)
        gen = torch.Generator().manual_seed(seed)
        self.features = torch.randn(pool, 16, generator=gen)

    def __getitem__(self, index: int):
        index = self._check(index)
        row = index % len(self.features)
        return self.features[row].clone(), index % 10


class ImageDataset(_PooledDataset):
    """A decoded 3x224x224 uint8 image and an int label: the vision case."""

    def __init__(self, length: int = _DEFAULT_LENGTH, pool: int = 8, seed: int = 0) -> None:
        super().__init__(length)
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (pool, 3, 224, 224), dtype=torch.uint8, generator=gen)

    def __getitem__(self, index: int):
        index = self._check(index)
        return self.images[index % len(self.images)].clone(), index % 1000


# Mixed dtypes and shapes, as in a multi-task or recommendation sample.
_DICT_FIELDS = [
    (f"f{k:02d}", dtype, shape)
    for k, (dtype, shape) in enumerate(
        [(torch.float32, (4,)), (torch.int64, (2,)), (torch.bool, (8,)), (torch.float16, (3,))] * 8
    )
]


class DictDataset(_PooledDataset):
    """A dict of 32 small tensors per sample: many leaves, little data."""

    def __init__(self, length: int = _DEFAULT_LENGTH, pool: int = 256, seed: int = 0) -> None:
        super().__init__(length)
        gen = torch.Generator().manual_seed(seed)
        self.pool_size = pool
        self.pools = {}
        for name, dtype, shape in _DICT_FIELDS:
            values = torch.randn((pool, *shape), generator=gen)
            if dtype == torch.bool:
                values = values > 0
            elif dtype == torch.int64:
                values = (values * 1000).long()
            self.pools[name] = values.to(dtype)

    def __getitem__(self, index: int):
        index = self._check(index)
        row = index % self.pool_size
        return {name: values[row].clone() for name, values in self.pools.items()}


_RECORD_DTYPE = np.dtype([
    ("features", np.float32, (32,)),
    ("token_ids", np.int64, (16,)),
    ("mask", np.bool_, (16,)),
    ("score", np.float64),
    ("label", np.int32),
])


class NumpyRecordDataset(_PooledDataset):
    """Rows of a numpy structured array, returned as a dict of numpy arrays and scalars.

    default_collate cannot stack structured dtypes, so a record is split into
    its fields, which is what a dataset over a structured table does.
    """

    def __init__(self, length: int = _DEFAULT_LENGTH, pool: int = 1024, seed: int = 0) -> None:
        super().__init__(length)
        rng = np.random.default_rng(seed)
        table = np.zeros(pool, dtype=_RECORD_DTYPE)
        table["features"] = rng.standard_normal((pool, 32), dtype=np.float32)
        table["token_ids"] = rng.integers(0, 50_000, (pool, 16))
        table["mask"] = rng.random((pool, 16)) > 0.2
        table["score"] = rng.random(pool)
        table["label"] = rng.integers(0, 10, pool)
        self.table = table

    def __getitem__(self, index: int):
        index = self._check(index)
        record = self.table[index % len(self.table)]
        return {
            "features": record["features"].copy(),
            "token_ids": record["token_ids"].copy(),
            "mask": record["mask"].copy(),
            "score": record["score"],
            "label": record["label"],
        }


class CpuHeavyDataset(_PooledDataset):
    """Per-sample Python compute (1-2 ms on a current x86 core), then a small tensor.

    Stands in for decoding and augmentation.  The work is a fixed number of
    iterations, not a fixed time, so the dataset stays deterministic and a
    faster machine simply runs it faster.
    """

    def __init__(self, length: int = _DEFAULT_LENGTH, iterations: int = 10_000,
                 pool: int = 256, seed: int = 0) -> None:
        super().__init__(length)
        self.iterations = int(iterations)
        gen = torch.Generator().manual_seed(seed)
        self.features = torch.randn(pool, 64, generator=gen)

    def __getitem__(self, index: int):
        index = self._check(index)
        acc = index & 0xFFFF
        for k in range(self.iterations):
            acc = (acc * 1103515245 + 12345 + k) & 0x7FFFFFFF
        scale = 1.0 + (acc % 7) / 7.0
        return self.features[index % len(self.features)] * scale, acc % 10


@dataclass(frozen=True)
class Workload:
    """One row of the bench table: a dataset factory and how to batch and time it."""

    name: str
    description: str
    make: Callable[[int], Any]
    batch_size: int
    # Timed batches per run: at least about half a second for the fastest loader
    # on 2 cores (a run of 0.1 s is at the mercy of the scheduler: its ratios
    # moved by 1.5x between two runs of the bench), a few seconds for torch's.
    batches: int
    collate_fn: Callable | None = None  # None: the loader's default_collate
    requires: tuple[str, ...] = ()  # modules the dataset imports; missing: skipped

    def dataset(self, length: int):
        return self.make(length)

    def skip_note(self) -> str | None:
        """The one line that says why this workload cannot run here, or None."""
        for module in self.requires:
            problem = import_problem(module)
            if problem is not None:
                return f"workload {self.name}: skipped, {problem} (pip install {_PIP[module]})"
        return None


_PIP = {"PIL": "pillow", "datasets": "datasets"}


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("small", "16 float32 + int label per sample, batch 64", SmallDataset, 64, 3000),
        Workload("image", "uint8 3x224x224 + int label per sample, batch 64",
                 ImageDataset, 64, 600),
        Workload("dict30", "dict of 32 small tensors (4 dtypes) per sample, batch 64",
                 DictDataset, 64, 200),
        Workload("numpy", "numpy record split into 5 arrays/scalars per sample, batch 64",
                 NumpyRecordDataset, 64, 1500),
        Workload("cpu_heavy", "1-2 ms of Python compute per sample, batch 16",
                 CpuHeavyDataset, 16, 200),
        Workload("jpeg", "JPEG files from disk: PIL decode, random-resized-crop 224, flip, "
                 "CHW uint8, batch 32", pipelines.JpegFolderDataset, 32, 30,
                 requires=("PIL",)),
        Workload("text", "32-512 token ids per sample, padding collate_fn (input_ids, "
                 "attention_mask, labels), batch 32", pipelines.TokenDataset, 32, 400,
                 collate_fn=pipelines.pad_collate),
        Workload("hf", "datasets.Dataset rows, with_format('torch'), memory-mapped: "
                 "128 ids, mask, label, batch 64", pipelines.hf_dataset, 64, 300,
                 requires=("datasets",)),
    ]
}


def small() -> Dataset:
    """Factory for the tuner CLI: the ``small`` workload's dataset."""
    return SmallDataset()


def image() -> Dataset:
    """Factory for the tuner CLI: the ``image`` workload's dataset."""
    return ImageDataset()


def dict30() -> Dataset:
    """Factory for the tuner CLI: the ``dict30`` workload's dataset."""
    return DictDataset()


def numpy_records() -> Dataset:
    """Factory for the tuner CLI: the ``numpy`` workload's dataset."""
    return NumpyRecordDataset()


def cpu_heavy() -> Dataset:
    """Factory for the tuner CLI: the ``cpu_heavy`` workload's dataset."""
    return CpuHeavyDataset()


def jpeg() -> Dataset:
    """Factory for the tuner CLI: the ``jpeg`` workload's dataset."""
    return pipelines.JpegFolderDataset(_DEFAULT_LENGTH)


def text() -> torch.utils.data.DataLoader:
    """Factory for the tuner CLI: the ``text`` workload, as a loader that keeps its
    padding ``collate_fn`` (the tuner keeps a loader's arguments)."""
    return torch.utils.data.DataLoader(pipelines.TokenDataset(_DEFAULT_LENGTH),
                                       batch_size=32, collate_fn=pipelines.pad_collate)


def hf():
    """Factory for the tuner CLI: the ``hf`` workload's dataset (65536 rows)."""
    return pipelines.hf_dataset(1 << 16)
