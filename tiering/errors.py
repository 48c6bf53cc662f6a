"""Errors raised by block stores and the object format, caught by the async-tier adapter."""


class ObjectNotFoundError(KeyError):
    """The store has no object for the key."""


class CorruptObjectError(ValueError):
    """A stored object failed verification (bad magic or version, foreign layout, another
    key, a short or long payload, a CRC mismatch); its bytes must not be used."""


class StoreClosedError(RuntimeError):
    """The block store was used before `open()` or after `close()`."""
