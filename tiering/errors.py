"""Every error the engine raises on purpose, in one tree rooted at `TieringError`.

```
TieringError
├── ConfigError            a configuration that cannot be used (file, key paths, problems)
│   └── TierConfigError    one tier's config: unknown type, a class that cannot be loaded,
│                          bad options (key paths within the tier's config)
├── ObjectNotFoundError    a block store has no object for the key (also a KeyError)
├── CorruptObjectError     a stored object failed verification (also a ValueError)
│   ├── UnusableObjectError  unreadable for a reason of its own (EACCES, EIO, a FIFO ...)
│   └── ForgedObjectError    its seal does not open with the tier's keys (planted, altered)
├── HungCallError          a store call gave no answer in op_timeout_s (also a TimeoutError)
├── StoreClosedError       a block store used outside open .. close (also a RuntimeError)
├── RuntimeClosedError     work submitted to a shut-down `AsyncRuntime` (also a RuntimeError)
└── RegionInUseError       another live engine holds this shared region (also a RuntimeError)
```

Each also derives from the built-in exception it used to be, so ``except ValueError`` and the
like keep working. Wrong arguments to a function (a programming error, such as a negative
count passed in code) raise the built-in `ValueError` or `TypeError`; conditions of the
configuration, the data or the environment raise the classes above. `OSError` from the
operating system passes through unchanged, except where a docstring says otherwise.

Thread: any; the errors carry no state but their message.
"""

from __future__ import annotations

import errno


class TieringError(Exception):
    """The root of every error the engine raises on purpose."""


def describe(exc: BaseException) -> str:
    """An error as a user should read it: an `OSError`'s message and file name without the
    ``[Errno N]`` prefix, anything else as `str` gives it."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def describe_bind_error(exc: OSError, address: str, port: int) -> str:
    """Why a server could not listen on `address`:`port`, naming them."""
    if exc.errno == errno.EADDRINUSE:
        return f"{address}:{port} is in use by another process; choose another port (0: any free one)"
    return f"cannot listen on {address}:{port}: {describe(exc)}"


class ConfigError(TieringError, ValueError):
    """A configuration that cannot be used; every problem is reported at once.

    Attributes:
        source: the file (or ``<string>``, or the serving engine's setting it came from).
        problems: (key path, what is wrong) pairs; the path is empty for the whole file.
        lines: one line per problem (source, key path, what is wrong), as the message lists them.
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        self.lines = [f"{source}: {path}: {message}" if path else f"{source}: {message}" for path, message in problems]
        super().__init__("invalid configuration\n  " + "\n  ".join(self.lines))

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return type(self), (self.source, self.problems)


class TierConfigError(ConfigError):
    """One secondary tier's config cannot be built: its ``type`` names no known tier, the
    class cannot be imported or is not a tier, or its options are wrong. `problems` hold key
    paths within the tier's config (``root_dir``, ``inner.bucket``); `source` names the tier."""

    def located(self, path: str) -> list[tuple[str, str]]:
        """The problems with their key paths under `path`, the tier's place in a config."""
        return [(f"{path}.{key}" if key else path, message) for key, message in self.problems]


class ObjectNotFoundError(TieringError, KeyError):
    """The store has no object for the key."""


class CorruptObjectError(TieringError, ValueError):
    """A stored object failed verification (bad magic or version, foreign layout, another
    key, a short or long payload, a checksum mismatch); its bytes must not be used."""


class HungCallError(TieringError, TimeoutError):
    """A block-store call gave no answer within ``op_timeout_s``: the backend's calls have
    stopped returning (a hung mount, a frozen server). The tier turns unhealthy at once."""


class UnusableObjectError(CorruptObjectError):
    """A stored object cannot be read for a reason of its own, not of the backend: no
    permission, a directory, FIFO or symbolic link where the object should be, a media error
    (EIO) on its blocks. It is dropped and set aside like a corrupt object, and says nothing
    about the health of the tier."""


class ForgedObjectError(CorruptObjectError):
    """A stored object's seal does not open with the tier's keys (`tiering.tiers.seal`): it was
    planted or altered by someone without them, sealed by a deployment with other keys, or
    not sealed at all in a tier that has keys (and the reverse: sealed, in a tier without).
    It is a miss and is never loaded; unlike a corrupt object it is not deleted, since it
    may be another deployment's."""


class StoreClosedError(TieringError, RuntimeError):
    """The block store was used before `open()` or after `close()`."""


class RuntimeClosedError(TieringError, RuntimeError):
    """The `AsyncRuntime` was shut down; no more work is accepted."""


class RuntimeDeadError(RuntimeClosedError):
    """The `AsyncRuntime`'s loop thread died (its cause is logged when it does); nothing
    submitted to it will run."""


class RegionInUseError(TieringError, RuntimeError):
    """Another live engine holds this role (scheduler, or worker rank) of the shared region
    with the same instance id."""


def is_no_space(error: BaseException) -> bool:
    """Whether `error` is a device's, a quota's or a server's lack of room (ENOSPC, EDQUOT):
    a store that fails so fails alone, and succeeds again once room comes back."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
