"""Signing keys from files: ``--key-file``, the ``key_file`` option and ``KVSNAP_KEY_FILE``.

A key file holds one key per line as hexadecimal digits (at least 64: 32 bytes); blank lines
and lines starting with ``#`` are skipped. Across files and lines the first key signs and every
key verifies (rotation: put the new key first). Make one with :func:`new_key_text`, e.g.
``python -c "from kvsnap.store.keys import new_key_text; print(new_key_text())" > key``,
then ``chmod 600 key``: a key file that other users can read is refused, as ssh refuses a
private key they can read. As ssh does, a key file is also refused unless it belongs to this
process's user (or root) and neither it nor its directory (the one its name is in, and the one
it really is in when the name is a link) lets group or other users write: whoever can replace
the key can sign chunks.
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


def _check_owner(path: str, status: os.stat_result, what: str) -> None:
    """Refuse (``SnapshotIOError``) a key file whose ``what`` (the file or a directory holding
    it) belongs to another user than this process's and root."""
    if status.st_uid not in (os.geteuid(), 0):
        raise SnapshotIOError(
            f"{what} belongs to user id {status.st_uid}, not to this process's user "
            f"({os.geteuid()}) or root: whoever owns it can replace the key",
            file=path,
        )


def _directories_of(path: str) -> list[str]:
    """The directory the name ``path`` is in, and the one the file really is in when that
    differs (the name is a link, or under one)."""
    named = os.path.dirname(os.path.abspath(path))
    real = os.path.dirname(os.path.realpath(path))
    return [named] if real == named else [named, real]


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
    _check_owner(path, status, "key file")
    for directory in _directories_of(path):
        try:
            held_in = os.stat(directory)
        except OSError as error:
            raise SnapshotIOError(
                f"cannot check the key file's directory {directory}: {error.strerror}", file=path
            ) from error
        _check_owner(path, held_in, f"its directory {directory}")
        if held_in.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            mode = stat.S_IMODE(held_in.st_mode)
            raise SnapshotIOError(
                f"the key file's directory {directory} is writable by other users (mode "
                f"{mode:o}), who could replace the key; run: chmod go-w {directory}, or keep "
                "the key elsewhere",
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
