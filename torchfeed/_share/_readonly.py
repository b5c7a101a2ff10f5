"""The one error every write to a shared container raises, the methods that
raise it, and what copying one gives: shared containers are read-only in
every process."""

from __future__ import annotations


def read_only_error(container, operation: str) -> TypeError:
    kind = type(container).__name__
    original = container.original_type.__name__
    return TypeError(
        f"'{kind}' object does not support {operation}: this {original} is shared read-only "
        f"between processes (torchfeed.share). For a mutable copy, use {original}(x); to "
        f"change the shared data, build a new one and share it again.")


def refuse(operation: str, method: str):
    """A method that raises the read-only TypeError (named ``method``)."""

    def write(self, *args, **kwargs):
        raise read_only_error(self, operation)

    write.__name__ = write.__qualname__ = method
    write.__doc__ = f"Raises TypeError: a shared {operation} is not allowed."
    return write


def refusing(cls, operations: dict[str, str]):
    """Add to ``cls`` a refusing method for each ``method: operation``."""
    for method, operation in operations.items():
        setattr(cls, method, refuse(operation, method))
    return cls


class OneBuffer:
    """A read-only container's copy is the container itself, as a tuple's is:
    ``copy`` and ``deepcopy`` never duplicate the shared buffer."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self
