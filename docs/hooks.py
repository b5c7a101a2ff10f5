"""MkDocs hook: the command lines' ``--help``, generated at build time.

A page that holds ``<!-- argparse: MODULE:FUNCTION -->`` on a line of its own
gets, in its place, the help text of the ``argparse.ArgumentParser`` that
``MODULE.FUNCTION()`` returns, so docs/reference/cli.md never drifts from the
options ``python -m torchfeed.tune`` and ``python -m torchfeed.bench`` take.
The checkout is put first on ``sys.path``: the site documents this tree.
"""
from __future__ import annotations

import importlib
import os
import re
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARKER = re.compile(r"^<!-- argparse: ([\w.]+):(\w+) -->$", re.M)


def _help(match: re.Match) -> str:
    if sys.path[0] != _ROOT:
        sys.path.insert(0, _ROOT)
    module = importlib.import_module(match.group(1))
    parser = getattr(module, match.group(2))()
    os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal; the page has one width
    try:
        text = parser.format_help()
    finally:
        del os.environ["COLUMNS"]
    return "```text\n" + text.rstrip() + "\n```"


def on_page_markdown(markdown: str, **kwargs) -> str:
    return _MARKER.sub(_help, markdown)
