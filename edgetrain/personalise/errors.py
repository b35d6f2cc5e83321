"""The personaliser's named errors: each says what is wrong and leaves the store as it was."""
from __future__ import annotations

from edgetrain.files.space import DiskFullError
from edgetrain.registry import EdgetrainError


class PersonaliseError(EdgetrainError):
    """Base of the personaliser's errors."""


class BadExampleError(PersonaliseError, ValueError):
    """An example that is not text, a chat, or an (input, label) pair edgetrain can train on."""


class WrongKindError(BadExampleError):
    """An example of a kind the store's model does not learn from (text for a classifier, a labelled
    input for a decoder, an input of the wrong size or a label outside the classes)."""


class StoreError(PersonaliseError, OSError):
    """A store that cannot be opened or written (not a directory, no permission, locked too long)."""


class DamagedStoreError(StoreError):
    """The store's database file is damaged (not SQLite, or malformed). The file is left untouched."""


class StoreFullError(StoreError, DiskFullError):
    """The disk holding the store has no room for what was being written; SQLite rolled it back, so the
    examples and versions already stored are as they were."""


class StoreVersionError(StoreError):
    """The store was written by a newer edgetrain (a newer schema); it is left untouched, so that edgetrain
    keeps working with it."""


class StoreBusyError(StoreError):
    """Another process (or another Personaliser in this one) is training on the store."""


class ModelMismatchError(PersonaliseError):
    """The store was created for another base model (or method, or held-out split) than the one asked for."""


class NothingToRollBackError(PersonaliseError):
    """rollback() with no promoted version: the base model is already what is served."""


class RetainSetError(PersonaliseError):
    """The store's retain set (what the forgetting guard scores a candidate on) is missing, damaged or cannot
    be built. A missing or damaged set of the base model's answers is rebuilt from its prompts (a
    `retain_rebuilt` event says why); this error is for what cannot be rebuilt."""
