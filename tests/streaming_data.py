"""300 samples written with each streaming library's own writer, for the tests of
tests/test_streaming_libraries.py (no network: local folders only).

Sample ``i`` is ``{"x": i, "v": [i, i, i, i] as float32}``.  The libraries are
imported here only, so that the torchvision stand-in (``streaming_shim``) can
be put on ``sys.path`` first.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

N = 300
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "streaming_shim")


def use_torchvision_shim() -> None:
    """Put the stand-in on sys.path when no torchvision is installed (see its README).

    spawn and forkserver children get the parent's sys.path, so they import it too."""
    if importlib.util.find_spec("torchvision") is None:
        if SHIM not in sys.path:
            _check_for_torchvision_before_the_shim()
            sys.path.insert(0, SHIM)
        return
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a CUDA build beside the CPU torch, say
        raise RuntimeError(
            f"torchvision is installed but cannot be imported ({exc}); mosaicml-streaming "
            "imports it. Uninstall it (the tests then use tests/streaming_shim) or install "
            "one built for this torch.") from exc


def _check_for_torchvision_before_the_shim() -> None:
    """transformers (which mosaicml-streaming imports) decides once whether
    torchvision is installed: let it decide before the stand-in is visible, or a
    later test in this process would find its Trainer asking for torchvision."""
    if importlib.util.find_spec("transformers") is not None:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()


def drop_torchvision_shim() -> None:
    """Take the stand-in off ``sys.path`` and out of ``sys.modules`` again, so that
    a later test in the same process (Lightning, transformers' Trainer) finds no
    torchvision instead of one that raises.  The libraries already imported keep
    the names they took from it."""
    while SHIM in sys.path:
        sys.path.remove(SHIM)
    for name, module in list(sys.modules.items()):
        if (name == "torchvision" or name.startswith("torchvision.")) and \
                (getattr(module, "__file__", None) or "").startswith(SHIM):
            del sys.modules[name]


def sample(i: int) -> dict:
    return {"x": i, "v": np.full(4, i, np.float32)}


def write_mds(root: str) -> str:
    use_torchvision_shim()
    from streaming import MDSWriter

    # small shards, so that the 300 samples span several of them
    with MDSWriter(out=root, columns={"x": "int", "v": "ndarray:float32:4"},
                   size_limit=1 << 11) as writer:
        for i in range(N):
            writer.write(sample(i))
    return root


def write_litdata(root: str) -> str:
    # litdata's own writer, the one litdata.optimize writes its chunks with;
    # optimize itself starts a worker process and takes tens of seconds here.
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(root, chunk_bytes="4KB")
    for i in range(N):
        writer[i] = sample(i)
    writer.done()
    writer.merge()
    return root


WRITERS = {"streaming": write_mds, "litdata": write_litdata}


def check_sample(sample: dict, fail_at) -> dict:
    """A user's transform: raises ValueError on sample ``fail_at``, else returns the sample."""
    if fail_at is not None and int(sample["x"]) == fail_at:
        raise ValueError(f"transform failed on sample {fail_at}")
    return sample


def make_dataset(lib: str, root: str, fail_at=None):
    """The library's StreamingDataset over ``root``, shuffled; ``fail_at``: the
    sample whose read raises ValueError (a user's transform failing).

    Each library's class lives in a module of its own, so that a worker imports
    only the library its dataset belongs to."""
    use_torchvision_shim()  # mosaicml-streaming imports torchvision
    if lib == "streaming":
        from streaming_failing_mds import FailingMDS

        return FailingMDS(fail_at, local=root, shuffle=True, batch_size=8, shuffle_seed=7)
    from streaming_failing_litdata import FailingLitdata

    return FailingLitdata(fail_at, root, shuffle=True, seed=7)


def library_loader(lib: str, dataset, **kwargs):
    """The library's own StreamingDataLoader."""
    if lib == "streaming":
        from streaming import StreamingDataLoader
    else:
        from litdata import StreamingDataLoader
    return StreamingDataLoader(dataset, **kwargs)


def xs(batch) -> list:
    return batch["x"].tolist()
