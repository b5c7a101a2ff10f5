"""litdata's StreamingDataset with a transform that can fail, as a user's would.

Imports litdata at module level (workers unpickle this class by name), and not
mosaicml-streaming, which a spawned worker would otherwise import for nothing
(seconds of CPU: it imports transformers).  Import it through
``streaming_data.make_dataset``; mosaicml-streaming's twin is ``streaming_failing_mds``.
"""
from __future__ import annotations

import litdata
import streaming_data as sd


class FailingLitdata(litdata.StreamingDataset):
    def __init__(self, fail_at, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at = fail_at

    def __getitem__(self, index):
        return sd.check_sample(super().__getitem__(index), self.fail_at)
