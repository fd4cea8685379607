"""The errors kvsnap raises on purpose, as one small typed hierarchy, and the rule they follow.

The rule: whose problem an error is shows in its type, so a caller (and the CLI's exit codes)
never parses a message to decide what to do.

* **The caller's mistake** is a ``ValueError``, ``TypeError``, ``KeyError`` or ``IndexError``,
  or a ``KVSnapError`` that is also one of those (``LayoutError``, ``ModelLoadError``,
  ``UnknownSequenceError``). Fix the call: repeating it fails the same way.
* **A bad file** is corruption: ``SnapshotCorruptError`` (``RestoreIncompleteError`` when some
  pages of a restore failed their checksums), or, before any byte is trusted,
  ``NotASnapshotError``, ``UnsupportedVersionError`` or a ``SignatureError``.
* **A valid snapshot that does not fit** the target cache, model or request is
  ``IncompatibleSnapshotError`` (``CacheCapacityError``, ``UnknownSequenceError``).
* **The environment failing** is an I/O error (``SnapshotIOError``, the ``OSError`` as its
  ``__cause__``) or a backend error (``BackendUnavailableError``, ``TransferFailedError``,
  ``RankFailedError``, or the ``RuntimeError`` torch or CUDA raised). Retrying may help. A
  write the process stopped because it is shutting down is ``SaveAbandonedError``.

Anything else escaping kvsnap is a bug in kvsnap. An unknown sequence id is the one error that
is two of these at once: a lookup by a wrong id, and a snapshot that cannot serve the request,
so every API that takes a sequence id raises ``UnknownSequenceError`` for it, which both
``except KeyError`` and ``except IncompatibleSnapshotError`` catch. Every class here is
importable from ``kvsnap``::

    KVSnapError
    ├── SnapshotCorruptError      a kvsnap snapshot whose bytes or structure are wrong
    │   └── RestoreIncompleteError  pages that failed their checksums were not restored
    ├── NotASnapshotError         not a kvsnap snapshot at all (garbage, empty, foreign file)
    ├── UnsupportedVersionError   a snapshot format this kvsnap cannot read (too new)
    ├── SignatureError            a file that a key-checking reader must not trust
    │   ├── UnsignedSnapshotError   it carries no signature
    │   └── BadSignatureError       its signature is not one of the keys' over its bytes
    ├── IncompatibleSnapshotError a valid snapshot that does not fit the target
    │   ├── CacheCapacityError    the target cache has too few free blocks
    │   └── UnknownSequenceError  no sequence of that id in the snapshot (also a KeyError)
    ├── SnapshotIOError           the operating system or object store failed us
    ├── LayoutError               a cache description kvsnap cannot map (also a ValueError)
    ├── BackendUnavailableError   a copy backend that cannot run here (also a RuntimeError)
    ├── TransferFailedError       a copy between the cache and staging failed or was refused
    ├── RankFailedError           another TP rank failed or was lost (kvsnap.distributed)
    ├── SaveAbandonedError        a queued save stopped unpublished because its process is exiting
    └── ModelLoadError            a model that cannot be loaded offline (also a ValueError)

Messages name the file, the tensor and the block wherever they are known, and the same
values are available as attributes (``file``, ``tensor``, ``block``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _location(file: str | None, tensor: str | None, block: int | None) -> str:
    """``"snap.safetensors: tensor layers.3.key, block 17: "``, leaving out what is unknown."""
    parts = []
    if file is not None:
        parts.append(str(file))
    if tensor is not None:
        parts.append(f"tensor {tensor}")
    if block is not None:
        parts.append(f"block {block}")
    return (", ".join(parts) + ": ") if parts else ""


def _rebuild(cls: type[KVSnapError], args: tuple[Any, ...], state: dict[str, Any]) -> KVSnapError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class KVSnapError(Exception):
    """Base class of every error kvsnap raises on purpose.

    ``file``, ``tensor`` and ``block`` locate the problem when known (``None`` otherwise);
    ``detail`` is the message without that location prefix.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        tensor: str | None = None,
        block: int | None = None,
    ) -> None:
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.block = None if block is None else int(block)
        self.detail = message
        super().__init__(_location(self.file, tensor, self.block) + message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only constructor arguments do not survive Exception's default pickling, and
        # errors cross process boundaries (worker pools, the crash-test child processes).
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class SnapshotCorruptError(KVSnapError):
    """A kvsnap snapshot whose bytes or structure are wrong: a checksum mismatch, truncation,
    offsets that overlap or leave gaps, metadata that contradicts the tensors."""


class SignatureError(KVSnapError):
    """A snapshot file that a reader given signing keys must not trust: unsigned, or signed
    other than by one of the keys over exactly its header and checksum trailer. Not
    corruption: its checksums may all be right (someone without the key wrote it)."""


class UnsignedSnapshotError(SignatureError):
    """A snapshot file without a signature, read by a reader that requires one."""


class BadSignatureError(SignatureError):
    """A signature that does not verify: made with a key the reader does not hold, or over
    other bytes (the header or the checksum trailer changed after signing)."""


class NotASnapshotError(KVSnapError):
    """The file is not a kvsnap snapshot: empty, garbage, or a safetensors file without kvsnap
    metadata."""


class UnsupportedVersionError(KVSnapError):
    """The snapshot uses a format version this kvsnap cannot read (``version``); newer
    versions need a newer kvsnap."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        version: object = None,
    ) -> None:
        super().__init__(message, file=file)
        self.version = version


class IncompatibleSnapshotError(KVSnapError):
    """A valid snapshot that does not fit the target cache or model.

    The message names both sides; ``snapshot`` and ``target`` optionally carry the two
    differing values (e.g. ``"8 KV heads"`` and ``"4 KV heads"``) for programmatic use.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        snapshot: object = None,
        target: object = None,
    ) -> None:
        super().__init__(message, file=file)
        self.snapshot = snapshot
        self.target = target


class SnapshotIOError(KVSnapError):
    """Reading or writing failed below kvsnap: the OS, the filesystem or the object store
    (disk full, permission denied, connection lost). ``__cause__`` holds the original error."""


class CacheCapacityError(IncompatibleSnapshotError):
    """The target cache has too few free blocks for a restore."""


class UnknownSequenceError(IncompatibleSnapshotError, KeyError):
    """A sequence id the snapshot does not hold, given to a restore, a read or a statistic.

    ``sequence_id`` is the id asked for and ``known`` the ids the snapshot holds. It is a
    ``KeyError`` (a lookup by a wrong id) and an ``IncompatibleSnapshotError`` (a snapshot that
    cannot serve the request) at once, so that either ``except`` catches it wherever it is
    raised.
    """

    def __init__(
        self, sequence_id: str, known: Iterable[str] = (), *, file: str | None = None
    ) -> None:
        self.sequence_id = sequence_id
        self.known = tuple(known)
        listed = ", ".join(repr(known_id) for known_id in self.known[:8])
        if len(self.known) > 8:
            listed += f", ... ({len(self.known)} in all)"
        super().__init__(f"no sequence {sequence_id!r} (it has: {listed or 'none'})", file=file)

    def __str__(self) -> str:
        # KeyError shows its argument as a quoted repr; this message is a sentence like the rest.
        return Exception.__str__(self)


class LayoutError(KVSnapError, ValueError):
    """A cache description that kvsnap cannot map exactly onto the canonical page."""


class BackendUnavailableError(KVSnapError, RuntimeError):
    """A copy backend that cannot run here (no CUDA, a missing package or driver entry point)."""


#: The name this error had before every error class ended in ``Error``; kept for callers.
BackendUnavailable = BackendUnavailableError


class TransferFailedError(KVSnapError):
    """A copy between the engine cache and the staging memory failed or was refused."""


class RankFailedError(KVSnapError):
    """A distributed capture or restore failed on some TP rank, or lost one (a collective
    failed). Raised on every surviving rank; ``failures`` maps each failed rank to its error
    message (empty when the group itself was lost)."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        failures: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, file=file)
        self.failures = dict(failures or {})


class SaveAbandonedError(KVSnapError):
    """A queued save that its process stopped before publishing it, because the process is
    shutting down and the time it had to finish its saves ran out (the vLLM connector's
    bounded shutdown). Nothing of it is published and its temporary file is removed; the KV it
    would have held is saved again the next time an engine computes it."""


class ModelLoadError(KVSnapError, ValueError):
    """A model named on the command line or to ``load_model`` cannot be loaded offline."""


class RestoreIncompleteError(SnapshotCorruptError):
    """Some pages of a restore failed their checksum and were not written; every other page
    was. ``failed_block_ids`` lists the target blocks not (fully) restored (sorted numpy
    int64), which an engine recomputes; ``result`` is the restore's result otherwise."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        failed_block_ids: Any = None,
        result: Any = None,
    ) -> None:
        super().__init__(message, file=file)
        self.failed_block_ids = failed_block_ids
        self.result = result
