"""Each library's StreamingDataset with a transform that can fail, as a user's would.

Imports the libraries at module level (workers unpickle these classes by name):
import it through ``streaming_data.make_dataset``, which sets up the torchvision
stand-in first.
"""
from __future__ import annotations

import litdata
import streaming


def _check(sample, fail_at):
    if fail_at is not None and int(sample["x"]) == fail_at:
        raise ValueError(f"transform failed on sample {fail_at}")
    return sample


class FailingMDS(streaming.StreamingDataset):
    def __init__(self, fail_at, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def __getitem__(self, index):
        return _check(super().__getitem__(index), self.fail_at)


class FailingLitdata(litdata.StreamingDataset):
    def __init__(self, fail_at, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at

    def __getitem__(self, index):
        return _check(super().__getitem__(index), self.fail_at)
