"""Datasets for ``share_dataset=True`` tests: annotation records, and a
COCO-like index with pycocotools' attribute layout.

``COCOLike`` builds the same attributes ``pycocotools.coco.COCO`` builds from
an annotation file (``dataset``, ``anns``, ``imgs``, ``cats``, ``imgToAnns``
and ``catToImgs``, the last two ``defaultdict(list)``), so the tests need no
pycocotools; ``CocoDetectionLike`` reads it as torchvision's ``CocoDetection``
does.  Importable by spawned workers.
"""
from __future__ import annotations

import itertools
import os
import signal
from collections import defaultdict

import numpy as np
import torch


def annotation(i: int) -> dict:
    """One COCO-like annotation: ids, a 4-float bbox, a 16-float polygon (about 1 KiB)."""
    return {"id": i, "image_id": i // 5, "category_id": i % 80,
            "bbox": [float(i % 640), float(i % 480), 32.0 + i % 7, 24.0 + i % 5],
            "segmentation": [[float((i + j) % 512) for j in range(16)]],
            "area": float(i % 1000), "iscrowd": 0}


class WeakDict(dict):
    """A record a weak reference can follow (a plain dict cannot have one)."""


def annotation_records(n: int) -> list:
    return [annotation(i) for i in range(n)]


def coco_json(images: int, without_annotations_every: int = 7) -> dict:
    """An annotation file as ``json.load`` gives it: every ``without_annotations_every``-th
    image has no annotation (so ``imgToAnns`` lacks it, as in pycocotools)."""
    anns = [annotation(i) for i in range(images * 5)
            if (i // 5) % without_annotations_every != 3]
    return {"images": [{"id": k, "file_name": f"{k:012d}.jpg", "height": 480, "width": 640}
                       for k in range(images)],
            "annotations": anns,
            "categories": [{"id": c, "name": f"category {c}", "supercategory": "thing"}
                           for c in range(80)]}


class COCOLike:
    """``pycocotools.coco.COCO``'s attributes and the three lookups torchvision calls."""

    def __init__(self, dataset: dict) -> None:
        self.dataset = dataset
        self.anns, self.cats, self.imgs = {}, {}, {}
        self.imgToAnns, self.catToImgs = defaultdict(list), defaultdict(list)
        for ann in dataset["annotations"]:
            self.imgToAnns[ann["image_id"]].append(ann)
            self.anns[ann["id"]] = ann
        for img in dataset["images"]:
            self.imgs[img["id"]] = img
        for cat in dataset["categories"]:
            self.cats[cat["id"]] = cat
        for ann in dataset["annotations"]:
            self.catToImgs[ann["category_id"]].append(ann["image_id"])

    def getAnnIds(self, imgIds):  # noqa: N802, N803 (pycocotools' names)
        lists = [self.imgToAnns[i] for i in imgIds if i in self.imgToAnns]
        return [ann["id"] for ann in itertools.chain.from_iterable(lists)]

    def loadAnns(self, ids):  # noqa: N802
        return [self.anns[i] for i in ids]

    def loadImgs(self, ids):  # noqa: N802
        return [self.imgs[i] for i in ids]


class CocoDetectionLike(torch.utils.data.Dataset):
    """Reads ``self.coco`` as torchvision's ``CocoDetection`` does; a sample is
    a tensor of what it read, so batches compare exactly."""

    def __init__(self, images: int) -> None:
        self.coco = COCOLike(coco_json(images))
        self.ids = sorted(self.coco.imgs.keys())
        self.note = list(range(100))  # small: left as it is

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        image_id = self.ids[index]
        image = self.coco.loadImgs([image_id])[0]
        target = self.coco.loadAnns(self.coco.getAnnIds([image_id]))
        direct = self.coco.imgToAnns[image_id]  # a missing key: defaultdict's []
        return torch.tensor([
            image_id, image["height"], len(target), len(direct),
            sum(sum(a["bbox"]) for a in target),
            sum(sum(a["segmentation"][0]) for a in target),
            sum(self.coco.cats[a["category_id"]]["id"] for a in target),
            self.note[index % 100]], dtype=torch.float64)


class Records(torch.utils.data.Dataset):
    """Sample ``i`` is a summary of ``records[i]``; ``die_at``: the worker that
    loads that index first SIGKILLs itself, once (``marker`` says it did)."""

    def __init__(self, records, die_at: int | None = None, marker: str | None = None) -> None:
        self.records = records
        self.labels = [0, 1, 2]
        self.die_at, self.marker = die_at, marker

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        if i == self.die_at and self.marker and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        r = self.records[i]
        return torch.tensor([r["id"], sum(r["bbox"]), sum(r["segmentation"][0])],
                            dtype=torch.float64)


def own_private_bytes(pid: int) -> int:
    """A process's private memory (Private_Clean + Private_Dirty, as USS counts
    it) outside torchfeed's shared buffers.

    A page of a shared buffer (a ``memfd:torchfeed-share`` mapping) that only
    this process has touched counts as private in USS, yet it is the one copy
    every process maps, not a copy of this worker's own: left out here."""
    total, shared_buffer = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: address range, ..., name
                shared_buffer = "memfd:torchfeed-share" in line
            elif head in ("Private_Clean:", "Private_Dirty:") and not shared_buffer:
                total += int(line.split()[1]) * 1024
    return total


class WritesInPlace(torch.utils.data.Dataset):
    """Issue 52's crash: ``x = torch.from_numpy(self.feats[i]); x.sub_(0.5)``
    over a 4096x64 float array, and a tensor beside it."""

    def __init__(self) -> None:
        self.feats = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64) / 1000
        self.weights = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)

    def __len__(self) -> int:
        return len(self.feats)

    def __getitem__(self, i: int):
        x = torch.from_numpy(self.feats[i])
        return x.sub_(0.5) + self.weights[i]


class Clip(torch.utils.data.Dataset):
    """One clip of a ``ConcatDataset`` of many: a 1.3 MiB list of frame records."""

    def __init__(self, clip: int, frames: int = 4000) -> None:
        self.frames = [(clip, i, f"clip{clip:03d}/frame{i:05d}.jpg") for i in range(frames)]

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, i: int):
        clip, frame, _ = self.frames[i]
        return torch.tensor([clip, frame, len(share_descriptors())])


def share_descriptors() -> list[str]:
    """This process's descriptors of torchfeed.share's memory."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "torchfeed-share" in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(fd)
        except OSError:
            pass
    return found


class Rows(torch.utils.data.Dataset):
    """Sample ``i`` is row ``i`` of ``feats``, as it is (a view, with ``collate_fn=list``)."""

    def __init__(self, feats) -> None:
        self.feats = feats

    def __len__(self) -> int:
        return len(self.feats)

    def __getitem__(self, i: int):
        return self.feats[i]
