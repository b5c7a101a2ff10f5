"""multiprocessing's temporary folder in the workers: nothing left in /tmp.

A worker that sends a tensor through torch's own transport (``transport="torch"``,
or a tensor or batch torchfeed's slots cannot carry) hands over its file
descriptors through multiprocessing's ``resource_sharer``, whose listening
socket lives in multiprocessing's temporary folder (``/tmp/pymp-*``). Left to
multiprocessing, a worker makes that folder on first use and removes it only
when it exits normally. So a worker the OOM killer ends leaves its folder
behind (torch's loader does too), and so did every worker whose main process
was SIGKILLed: the watchdog ends it with ``os._exit``, which skips
multiprocessing's cleanup.

Two rules:

- A worker that finds the main process gone removes the folder it uses, unless
  it inherited it from the main process (``leave``).
- Where every batch goes torch's way with torch's default sharing strategy
  (``transport="torch"``), the main process makes one folder per iterator and
  names it as each worker's before starting it (multiprocessing keeps the name
  in the process object, which every start method hands to the child, and
  never removes a folder it did not make). It removes the folder once its
  workers are stopped, killed ones included. It is not made for the default
  transport, which hands over no descriptors unless a batch falls back: a
  folder made for every iterator would be left behind whenever the main
  process and its workers are all SIGKILLed at once, where today none is.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile

import torch.multiprocessing

# A socket's path must fit sun_path (108 bytes with its NUL); multiprocessing
# names its listeners "<folder>/listener-" and eight random characters.
_LONGEST_FOLDER = 107 - len("/listener-12345678")


def wanted(channel) -> bool:
    """Whether an iterator with ``channel`` gets a folder of its own: its workers
    hand over every batch's descriptors through sockets."""
    return (getattr(channel, "kind", None) == "torch"
            and torch.multiprocessing.get_sharing_strategy() == "file_descriptor")


def make() -> str | None:
    """A new, empty folder for one iterator's workers; None where none can be
    made (no writable temporary folder) or sockets would not fit under it."""
    try:
        folder = tempfile.mkdtemp(prefix="pymp-")
    except OSError:
        return None
    if len(os.fsencode(folder)) > _LONGEST_FOLDER:
        os.rmdir(folder)
        return None
    return folder


def hand_to(process, folder: str | None) -> None:
    """Name ``folder`` as the temporary folder of ``process``, not yet started
    (a process class of a context that keeps no such settings is left as it is)."""
    config = getattr(process, "_config", None)
    if folder is not None and isinstance(config, dict):
        config["tempdir"] = folder


def in_use() -> str | None:
    """This process's multiprocessing folder, if it has one yet."""
    return multiprocessing.current_process()._config.get("tempdir")  # type: ignore[attr-defined]


def leave(given: str | None, at_start: str | None) -> None:
    """A worker whose main process is gone, about to end with ``os._exit``:
    remove the iterator's folder (``given``) and the one it made itself (any
    but ``at_start``, what it had when it started; the iterator's, if given).
    A worker that returns normally removes only ``given``: multiprocessing
    removes the other, and would complain of a folder already gone."""
    remove(given)
    made = in_use()
    if made is not None and made != at_start:
        remove(made)


def remove(folder: str | None) -> None:
    """Remove ``folder`` and what the workers left in it; several processes may
    race to do so, and each one after the first finds nothing to do."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
