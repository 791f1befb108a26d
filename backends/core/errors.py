"""Errors a user can read. Every message says what is wrong and, where possible, what to do."""

from __future__ import annotations


class SpecDeckError(Exception):
    """Base class: anything SpecDeck reports to a person instead of crashing."""


class ModelFileError(SpecDeckError):
    """A model file is missing, not a GGUF, truncated or otherwise unusable."""


class HeadMismatchError(SpecDeckError):
    """A trained head made for another model than the one loaded."""


class IncompatibleDraftError(SpecDeckError):
    """A draft model cannot draft for this target (different vocabulary, special tokens ...)."""


class PromptTooLongError(SpecDeckError):
    """The prompt does not leave room in the context for a single new token."""


class BackendError(SpecDeckError):
    """The inference library failed (out of memory, decode error ...)."""


class UnknownMethodError(SpecDeckError):
    """A method name that is not in the registry."""


class Cancelled(SpecDeckError):
    """The user cancelled a long operation (loading a model); nothing was left half done."""
