"""Stand-in for torchvision in the tests of mosaicml-streaming only: see ../README.md.

``import streaming`` imports ``streaming.vision``, whose dataset classes subclass
torchvision's; nothing else of streaming touches torchvision.  Every name here
raises when used, so a code path that did need torchvision would fail loudly.
"""


def unavailable(what: str):
    raise RuntimeError(
        f"{what} is part of the tests' torchvision stand-in (tests/streaming_shim): the "
        "tested code paths must not use torchvision. Install a torchvision that loads "
        "with this torch to test them.")
