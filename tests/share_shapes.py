"""The shapes real datasets keep their data in, as a new user of
``share_dataset=True`` brings them (issue 52's held-out set), for
tests/test_share_shapes.py.  Importable by spawned workers.

* ``ImageFolderLike``: torchvision's ``ImageFolder`` as ``DatasetFolder``
  builds it (torchvision cannot be imported beside this CPU torch): ``root``,
  ``loader``, ``extensions``, ``transform``, ``target_transform``,
  ``classes``, ``class_to_idx``, ``samples`` (a list of ``(path,
  class_index)``), ``targets`` and ``imgs``, which is ``samples`` itself
  (``self.imgs = self.samples``);
* ``Shapes``: one dataset holding the others: a real pycocotools ``COCO``
  built from an annotation file, a pandas ``DataFrame``, a dict of numpy
  arrays (a sample is written in place, ``torch.from_numpy(row).sub_()``), a
  list of tensors and a list of file paths (pytorch issue 13246's case).

Each sample is a float64 tensor of what was read, so batches compare exactly.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import zlib

import numpy as np
import torch
from share_datasets import coco_json

CLASSES = 100


def default_loader(path: str) -> torch.Tensor:
    """Stands in for PIL's open of the file: a value that depends on the path only."""
    return torch.tensor([float(zlib.crc32(path.encode()) % 10_007)])


class ImageFolderLike(torch.utils.data.Dataset):
    def __init__(self, root: str, images: int) -> None:
        self.root = root
        self.transform = self.target_transform = None
        self.loader = default_loader
        self.extensions = (".jpg", ".jpeg", ".png")
        self.classes = [f"n{c:08d}" for c in range(CLASSES)]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        samples = [(os.path.join(root, self.classes[i % CLASSES], f"{i:08d}.JPEG"), i % CLASSES)
                   for i in range(images)]
        self.samples = samples
        self.targets = [s[1] for s in samples]
        self.imgs = self.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        return torch.cat([self.loader(path), torch.tensor([float(target)])]).double()


def coco_from_file(folder: str, images: int):
    """pycocotools' own ``COCO``, built from an annotation file as users build it."""
    from pycocotools.coco import COCO

    path = os.path.join(folder, f"instances_{images}.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(coco_json(images), f)
    with contextlib.redirect_stdout(io.StringIO()):  # "loading annotations into memory..."
        return COCO(path)


class Shapes(torch.utils.data.Dataset):
    def __init__(self, folder: str, n: int = 20_000, images: int = 2000) -> None:
        import pandas as pd

        self.folder = ImageFolderLike(os.path.join(folder, "train"), n)
        self.coco = coco_from_file(folder, images)
        self.image_ids = sorted(self.coco.imgs)
        rng = np.random.default_rng(0)
        self.table = pd.DataFrame({"path": [f"/data/annotations/img_{i:08d}.jpg" for i in range(n)],
                                   "label": np.arange(n) % 7, "weight": rng.random(n),
                                   "box": rng.random(n), "score": rng.random(n)})
        self.arrays = {"x": rng.random((n, 16), dtype=np.float32), "y": np.arange(n)}
        self.tensors = [torch.full((16,), float(i)) for i in range(n)]
        self.paths = [f"/data/imagenet/train/n{i % 1000:08d}/{i:08d}.JPEG" for i in range(n)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        image = self.folder[i]
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=[self.image_ids[i % len(self.image_ids)]]))
        row = torch.from_numpy(self.arrays["x"][i])
        row.sub_(0.5)  # in place, as a transform may: the worker's own page
        return torch.cat([
            image, torch.tensor([float(self.folder.imgs[i][1]), float(len(anns)),
                                 sum(sum(a["bbox"]) for a in anns),
                                 float(self.table["label"].iat[i]), float(self.table["weight"].iat[i]),
                                 float(self.arrays["y"][i]), float(zlib.crc32(self.paths[i].encode()))],
                                dtype=torch.float64),
            row.double(), self.tensors[i].double()])
