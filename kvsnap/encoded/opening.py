"""An encoded snapshot opened as the ordinary snapshot it stands for: decoded into an fsspec
``memory://`` file that kvsnap's readers open like any other, removed again on close."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.encoded.file import EncodedFile
from kvsnap.encoded.original import read_local
from kvsnap.encoded.read import decode, is_encoded, parse_encoded
from kvsnap.format.signing import KeyRing
from kvsnap.store.read.head_parts import OpenedSnapshot, open_snapshot

#: Where decoded files are kept while open (fsspec's process-wide memory filesystem).
MEMORY_ROOT = "/kvsnap-decoded"
#: Threads decoding lossless chunks.
DECODE_THREADS = 2


def _local_path(path: str | os.PathLike[str]) -> str | None:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return None
    return text.removeprefix("file://")


def open_decoded(
    path: str | os.PathLike[str], keys: KeyRing | None = None
) -> tuple[str, EncodedFile] | None:
    """``(memory URL of the decoded file, the encoded file)`` when ``path`` is a local encoded
    snapshot (checked, with ``keys`` its signature), else ``None``."""
    local = _local_path(path)
    if local is None or not os.path.isfile(local):
        return None
    with open(local, "rb") as stream:
        prefix = stream.read(4096)
    if not _may_be_encoded(prefix):
        return None
    data = read_local(local)
    if not is_encoded(data):
        return None
    encoded = parse_encoded(data, local, keys)
    with ThreadPoolExecutor(DECODE_THREADS) as executor:
        decoded = decode(encoded, executor)
    name = f"{MEMORY_ROOT}/{uuid.uuid4().hex}/{Path(local).name}"
    _memory().pipe_file(name, np.ascontiguousarray(decoded).tobytes())
    return f"memory://{name}", encoded


def _may_be_encoded(prefix: bytes) -> bool:
    """A cheap first look: does the header's kvsnap metadata start with version 3?"""
    return b'format_version\\":3' in prefix


def release(url: str) -> None:
    """Remove a decoded file :func:`open_decoded` made."""
    name = url.removeprefix("memory://")
    fs = _memory()
    if fs.exists(name):
        fs.rm(name)


def _memory() -> Any:
    """fsspec's memory filesystem (imported when first needed: opening stays light)."""
    import fsspec  # type: ignore[import-untyped]

    return fsspec.filesystem("memory")


@dataclass(frozen=True)
class DecodedSnapshot:
    """An encoded snapshot opened as the ordinary one it decodes to."""

    #: The decoded file, opened.
    opened: OpenedSnapshot
    #: The encoded file it was decoded from.
    encoded: EncodedFile
    #: The decoded file's memory URL, for :func:`release` when the snapshot closes.
    url: str


def open_as_decoded(
    path: str | os.PathLike[str], keys: KeyRing | None, *, verify: bool
) -> DecodedSnapshot | None:
    """``path`` opened as the ordinary snapshot it decodes to when it is a local encoded
    snapshot (its signature checked with ``keys``), else ``None``; the decoded file is released
    again if the open fails."""
    decoded = open_decoded(path, keys)
    if decoded is None:
        return None
    url, encoded = decoded
    try:
        opened = open_snapshot(url, verify=verify)
    except BaseException:
        release(url)
        raise
    return DecodedSnapshot(opened, encoded, url)
