"""The bench's real pipelines: JPEG files from disk, padded text, Hugging Face datasets.

Owns the three workloads that look like what users train on rather than like
tensors in memory, and the data they read.  Nothing is downloaded: the bench
writes its own files, once, into a cache directory (see :func:`cache_dir`):

- ``jpeg``: an ``ImageFolder``-style tree of JPEG files, read and decoded with
  PIL, random-resized-crop to 224x224 and a random horizontal flip, returned as
  a CHW uint8 tensor: the ImageNet training pipeline.  torchvision is not
  needed: the crop follows the documented ``RandomResizedCrop`` algorithm
  (scale 0.08-1, aspect ratio 3/4-4/3, ten tries, then a centre crop);
- ``text``: token ids of 32 to 512 tokens per sample and a padding
  ``collate_fn`` that returns ``input_ids``, ``attention_mask`` and ``labels``;
- ``hf``: a ``datasets.Dataset`` saved to disk and loaded back memory-mapped,
  as ``load_dataset`` gives it, in torch format.  It goes to the loader as it
  is, so the loader's fetcher calls its ``__getitems__`` with each batch's
  indices, as torch's does.

Each sample's randomness comes from its index, so a sample is the same in any
process and under any loader: the bench can check that every loader delivers
the same batches.  PIL and ``datasets`` are optional; the workloads say which
module they need and the bench skips them, with a note, when it is missing.
"""
from __future__ import annotations

import math
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

CACHE_ENV = "TORCHFEED_BENCH_CACHE"
# Bump when what is written changes, so that an old cache is not read as new.
_JPEG_VERSION = 1
_HF_VERSION = 1


def cache_dir() -> Path:
    """Where the bench keeps the files it writes: ``$TORCHFEED_BENCH_CACHE``, else
    ``$XDG_CACHE_HOME/torchfeed/bench``, else ``~/.cache/torchfeed/bench``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchfeed" / "bench"


def _publish(build, target: Path) -> Path:
    """Run ``build(folder)`` into a fresh folder beside ``target``, then rename it into
    place: a reader sees the whole folder or none, and of two benches writing at
    once, one wins and the other's copy is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------- jpeg ----

def _photo(rng: np.random.Generator, width: int, height: int):
    """A picture with smooth regions and fine texture, so it compresses like a photo."""
    from PIL import Image

    coarse = rng.integers(0, 256, (height // 24 + 2, width // 24 + 2, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
    grain = rng.normal(0.0, 14.0, (height, width, 3))
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def write_jpeg_folder(root: Path, files: int, classes: int, seed: int = 0) -> None:
    """``files`` JPEGs of ImageNet's typical sizes (375-500 px a side) in ``classes``
    sub-folders, as ``ImageFolder`` expects."""
    rng = np.random.default_rng(seed)
    for k in range(files):
        folder = root / f"class_{k % classes:03d}"
        folder.mkdir(exist_ok=True)
        landscape = rng.random() < 0.7
        long_side, short_side = 500, int(rng.integers(333, 376))
        size = (long_side, short_side) if landscape else (short_side, long_side)
        _photo(rng, *size).save(folder / f"img_{k:05d}.jpg", "JPEG", quality=90)


def jpeg_folder(files: int = 320, classes: int = 10, root: Path | None = None) -> Path:
    """The folder of JPEGs, written on first use (a few seconds) and reused after."""
    target = (Path(root) if root is not None else cache_dir()) / \
        f"jpeg-v{_JPEG_VERSION}-{files}x{classes}"
    if not target.is_dir():
        print(f"torchfeed.bench: writing {files} JPEG files to {target} (once)",
              file=sys.stderr, flush=True)
        _publish(lambda folder: write_jpeg_folder(folder, files, classes), target)
    return target


def crop_box(rng: random.Random, width: int, height: int, scale=(0.08, 1.0),
             ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a random crop covering ``scale`` of the area at an
    aspect ratio in ``ratio`` (log-uniform); after ten misses, the largest centred
    crop whose aspect ratio is within ``ratio``."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class JpegFolderDataset(Dataset):
    """(CHW uint8 224x224 tensor, class index) from an ``ImageFolder``-style tree.

    Indices past the number of files wrap around, so a run of any length reads
    the same few hundred files (from the page cache after the first pass)."""

    def __init__(self, length: int, root: Path | None = None, files: int = 320,
                 classes: int = 10, size: int = 224, seed: int = 0) -> None:
        from PIL import Image  # noqa: F401  (fails here, not in a worker)

        folder = jpeg_folder(files, classes, root)
        self.classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        self.samples = [(str(path), label) for label, name in enumerate(self.classes)
                        for path in sorted((folder / name).glob("*.jpg"))]
        self.length, self.size, self.seed = int(length), size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        from PIL import Image

        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {type(self).__name__} "
                             f"of length {self.length}")
        path, label = self.samples[index % len(self.samples)]
        with open(path, "rb") as f:  # as ImageFolder's loader opens it
            img = Image.open(f).convert("RGB")
        rng = random.Random(self.seed * 1_000_003 + index)
        left, top, w, h = crop_box(rng, *img.size)
        img = img.resize((self.size, self.size), Image.BILINEAR,
                         box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        # HWC bytes to a CHW view, as torchvision's PILToTensor returns it.
        return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1), label


# ---------------------------------------------------------------- text ----

PAD_ID = 0
IGNORE_INDEX = -100  # what torch's cross_entropy skips by default


class TokenDataset(Dataset):
    """``{"input_ids": int64 tensor}`` of 32 to 512 tokens, as a tokenized corpus gives.

    Lengths are log-uniform, so short samples are common and long ones are
    not rare; the ids are copied out of one token pool built once."""

    def __init__(self, length: int, min_len: int = 32, max_len: int = 512,
                 vocab: int = 32_000, pool: int = 4096, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.length = int(length)
        self.tokens = torch.from_numpy(rng.integers(1, vocab, 1 << 18, dtype=np.int64))
        self.lengths = np.exp(rng.uniform(math.log(min_len), math.log(max_len + 1), pool)
                              ).astype(np.int64).clip(min_len, max_len)
        self.offsets = rng.integers(0, len(self.tokens) - max_len, pool)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {type(self).__name__} "
                             f"of length {self.length}")
        row = index % len(self.lengths)
        start = int(self.offsets[row])
        return {"input_ids": self.tokens[start:start + int(self.lengths[row])].clone()}


def pad_collate(samples):
    """Pad to the longest sample: ``input_ids`` (padded with ``PAD_ID``),
    ``attention_mask`` (1 on tokens) and ``labels`` (the ids, ``IGNORE_INDEX`` on padding)."""
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), width), PAD_ID, dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.int64)
    for row, sample in enumerate(samples):
        ids = sample["input_ids"]
        input_ids[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ------------------------------------------------------------------ hf ----

def _write_hf(folder: Path, rows: int, seq_len: int, seed: int) -> None:
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 4, seq_len + 1, rows)
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int8)
    ids = rng.integers(1, 32_000, (rows, seq_len), dtype=np.int32) * mask
    table = datasets.Dataset.from_dict({
        "input_ids": ids, "attention_mask": mask,
        "label": rng.integers(0, 2, rows, dtype=np.int64)})
    was_shown = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a bar per write would bury the bench's progress line
    try:
        table.save_to_disk(str(folder / "data"))
    finally:
        if was_shown:
            datasets.enable_progress_bars()


def hf_dataset(length: int, seq_len: int = 128, root: Path | None = None, seed: int = 0):
    """A ``datasets.Dataset`` of at least ``length`` tokenized rows (``input_ids``,
    ``attention_mask``: ``seq_len`` ids, padded as with ``padding="max_length"``;
    ``label``), memory-mapped from the cache, ``with_format("torch")``.

    The row count is ``length`` rounded up to a power of two (4096 at least),
    so that a few files serve every run length."""
    import datasets

    rows = max(4096, 1 << max(0, int(length) - 1).bit_length())
    target = (Path(root) if root is not None else cache_dir()) / \
        f"hf-v{_HF_VERSION}-{rows}x{seq_len}"
    if not target.is_dir():
        _publish(lambda folder: _write_hf(folder, rows, seq_len, seed), target)
    return datasets.load_from_disk(str(target / "data")).with_format("torch")
