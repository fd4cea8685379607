"""Signing keys from files: ``--key-file``, the ``key_file`` option and ``KVSNAP_KEY_FILE``.

A key file holds one key per line as hexadecimal digits (at least 64: 32 bytes); blank lines
and lines starting with ``#`` are skipped. Across files and lines the first key signs and every
key verifies (rotation: put the new key first). Make one with :func:`new_key_text`, e.g.
``python -c "from kvsnap.store.keys import new_key_text; print(new_key_text())" > key``,
then ``chmod 600 key``: a key file that other users can read is refused, as ssh refuses a
private key they can read.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Sequence

from kvsnap.errors import SnapshotIOError
from kvsnap.format.signing import MIN_KEY_BYTES, KeyRing

#: The environment variable naming key files (separated by ``os.pathsep``) when no key file
#: is given explicitly.
KEY_FILE_ENV = "KVSNAP_KEY_FILE"
_HEX = re.compile(r"[0-9a-fA-F]+")


def new_key_text() -> str:
    """A fresh random key as the line a key file holds (64 hex digits)."""
    return secrets.token_hex(MIN_KEY_BYTES)


def load_key_ring(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> KeyRing:
    """The keys in the key file(s) ``paths``, in order.

    Raises :class:`~kvsnap.errors.SnapshotIOError` when a file cannot be read or other users
    may read it, and ``ValueError`` for a line that is not a key or a file without one.
    """
    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    keys: list[bytes] = []
    for path in files:
        keys.extend(_keys_in(os.fspath(path)))
    if not keys:
        raise ValueError(f"no key in {', '.join(os.fspath(p) for p in files)}")
    return KeyRing(keys)


def key_ring_from_environment() -> KeyRing | None:
    """The keys of the files :data:`KEY_FILE_ENV` names, or ``None`` when it is unset."""
    value = os.environ.get(KEY_FILE_ENV, "")
    paths = [part for part in value.split(os.pathsep) if part]
    return load_key_ring(paths) if paths else None


def _keys_in(path: str) -> list[bytes]:
    try:
        with open(path, "rb") as file:
            status = os.fstat(file.fileno())
            raw = file.read(1 << 20)
    except OSError as error:
        raise SnapshotIOError(f"cannot read key file: {error.strerror}", file=path) from error
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SnapshotIOError(
            f"key file is accessible to other users (mode {stat.S_IMODE(status.st_mode):o}); "
            f"run: chmod 600 {path}",
            file=path,
        )
    keys = []
    for number, line in enumerate(raw.decode("ascii", "replace").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not _HEX.fullmatch(text) or len(text) % 2 or len(text) < 2 * MIN_KEY_BYTES:
            raise ValueError(
                f"{path}, line {number}: a key is at least {2 * MIN_KEY_BYTES} hex digits"
            )
        keys.append(bytes.fromhex(text))
    return keys
