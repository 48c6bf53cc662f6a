"""Errors raised by block stores and the object format, caught by the async-tier adapter."""


class ObjectNotFoundError(KeyError):
    """The store has no object for the key."""


class CorruptObjectError(ValueError):
    """A stored object failed verification (bad magic or version, foreign layout, another
    key, a short or long payload, a CRC mismatch); its bytes must not be used."""


class UnusableObjectError(CorruptObjectError):
    """A stored object cannot be read for a reason of its own, not of the backend: no
    permission, a directory, FIFO or symbolic link where the object should be, a media error
    (EIO) on its blocks. It is dropped and set aside like a corrupt object, and says nothing
    about the health of the tier."""


class StoreClosedError(RuntimeError):
    """The block store was used before `open()` or after `close()`."""
