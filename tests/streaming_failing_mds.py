"""mosaicml-streaming's StreamingDataset with a transform that can fail, as a user's would.

Imports the library at module level (workers unpickle this class by name), and
only this library: a spawned worker imports what its dataset's module imports,
and mosaicml-streaming (transformers with it) costs a second or more of CPU
there.  Import it through ``streaming_data.make_dataset``, which sets up the
torchvision stand-in first; litdata's twin is ``streaming_failing_litdata``.
"""
from __future__ import annotations

import streaming
import streaming_data as sd


class FailingMDS(streaming.StreamingDataset):
    def __init__(self, fail_at, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def __getitem__(self, index):
        return sd.check_sample(super().__getitem__(index), self.fail_at)
