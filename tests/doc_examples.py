"""The Python blocks of the documentation: README.md and every page under docs/.

A ```` ```python ```` block whose first line names a file (``# train_ddp.py``)
is a runnable example: the tests save it under that name and run it as
written (tests/test_readme.py, tests/test_gpu_feed.py).  The same example may
stand in several places (``quickstart.py`` is in README.md and on
docs/getting-started.md); it must then be the same text in each, so that
running it once checks them all.
Every other block is a fragment (it names a ``dataset`` or a ``model`` the
reader has), which must still compile (tests/test_docs.py).
"""
from __future__ import annotations

import os
import re
import textwrap
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# A fence at any indentation (a block inside a list item), up to the closing
# fence at the same indentation.
_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
_NAMED = re.compile(r"# ([\w-]+\.py)\n")


class Block(NamedTuple):
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str

    @property
    def name(self) -> str | None:
        """The example's file name (``train_ddp.py``), or None for a fragment."""
        match = _NAMED.match(self.code)
        return match.group(1) if match else None


def markdown_files() -> list[str]:
    """README.md and docs/**/*.md, relative to the repository root."""
    found = ["README.md"]
    for folder, _, files in os.walk(DOCS):
        found += sorted(os.path.relpath(os.path.join(folder, f), ROOT)
                        for f in files if f.endswith(".md"))
    return found


def python_blocks() -> list[Block]:
    blocks = []
    for path in markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        for match in _BLOCK.finditer(text):
            code = textwrap.dedent(match.group(1) + match.group(2)) if match.group(1) else match.group(2)
            blocks.append(Block(path, text.count("\n", 0, match.start()) + 1, code))
    return blocks


def doc_python_block(starting_with: str) -> str:
    """The text of the block whose first line is ``starting_with`` (an example's
    ``# name.py``, or the start of a fragment a test runs), from wherever it
    stands in README.md or docs/; where it stands in several places, each must
    hold the same text."""
    matches = [b for b in python_blocks() if b.code.startswith(starting_with)]
    assert matches, f"no ```python block of README.md or docs/ starts with {starting_with!r}"
    texts = {b.code for b in matches}
    assert len(texts) == 1, (f"the blocks starting with {starting_with!r} differ: "
                             + ", ".join(f"{b.path}:{b.line}" for b in matches))
    return matches[0].code
