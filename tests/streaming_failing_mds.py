"""mosaicml-streaming's StreamingDataset with a transform that can fail, as a user's would.

Imports the library at module level (workers unpickle this class by name), and
only this library: a spawned worker imports what its dataset's module imports,
and mosaicml-streaming (transformers with it) costs a second or more of CPU
there.  Import it through ``streaming_data.make_dataset``, which sets up the
torchvision stand-in first; litdata's twin is ``streaming_failing_litdata``.
"""
from __future__ import annotations

import os
import tempfile

import streaming
import streaming_data as sd


class FailingMDS(streaming.StreamingDataset):
    def __init__(self, fail_at, **kwargs):
        # The library makes two lock files per dataset in tempfile.gettempdir()
        # and never removes them (under torch's loader too): a hundred in /tmp
        # per run of the suite.  Its lock folder is read once, here: put them
        # beside the test's data, in pytest's temporary folder.
        locks = os.path.abspath(kwargs["local"]).rstrip(os.sep) + "-locks"
        os.makedirs(locks, exist_ok=True)
        saved, tempfile.tempdir = tempfile.tempdir, locks
        try:
            super().__init__(**kwargs)
        finally:
            tempfile.tempdir = saved
        self.fail_at = fail_at

    def __getitem__(self, index):
        return sd.check_sample(super().__getitem__(index), self.fail_at)
