"""Factories that tests/test_tune.py hands to ``python -m torchfeed.tune tune_helper:NAME``.

Kept out of the test module so that the tuner's command line imports a plain
module, as it would a user's.  Tiny on purpose: the tests check the tuner
works, never how fast anything is.
"""
import torch
from torch.utils.data import Dataset

import torchfeed


class TinyDataset(Dataset):
    """64 samples of a 4-float tensor and an int label."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if not 0 <= index < 64:
            raise IndexError(index)
        return torch.full((4,), float(index)), index % 3


def make_dataset():
    return TinyDataset()


def make_loader():
    return torchfeed.DataLoader(TinyDataset(), batch_size=4, shuffle=True)


def needs_args(size):
    return TinyDataset()


def not_a_dataset():
    return [1, 2, 3]


NOT_CALLABLE = 3
