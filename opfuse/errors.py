"""Errors opfuse raises on purpose: each says what was wrong and what to do."""

from __future__ import annotations


class OpfuseError(Exception):
    """Base class of every error opfuse raises on purpose."""


class ModelError(OpfuseError):
    """The model cannot be handled as given (invalid, unsupported, unbound dims, ...).

    The message is shown to users as-is: it names what is wrong and how to fix it.
    """


class BundleError(OpfuseError):
    """A bundle cannot be loaded here (format version, target mismatch, damaged file)."""


class InputError(OpfuseError):
    """The inputs given to a compiled model are invalid for it: an index out of its data's range.

    Raised by `CompiledModel.run` where the check costs nothing (the CPU): the message names the
    node, the value and the valid range. Map it to a client error (the caller's data is wrong).
    """


# What a report says where opfuse's own code raised and it carried on without the part that failed.
BUG_NOTE = "this is a bug in opfuse: please report it with the model"


def describe(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
