"""An encoded file's bytes and checked layout: its tensors' bytes by name, its encoding and its
recorded error report."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap.encoding.report import ErrorReport
from kvsnap.errors import SnapshotCorruptError, SnapshotIOError
from kvsnap.format import encoded as enc


class EncodedInfo:
    """What an encoded file's header says: its encoding, sizes and recorded error."""

    layout: enc.EncodedLayout
    file: str | None

    @property
    def encoding(self) -> dict[str, Any]:
        return self.layout.encoding

    @property
    def decoded_bytes(self) -> int:
        return int(self.encoding["decoded_bytes"])

    @property
    def ratio(self) -> float:
        """Decoded bytes per stored byte."""
        return self.decoded_bytes / max(self.layout.file_size, 1)

    @property
    def error(self) -> ErrorReport | None:
        raw = self.encoding.get("error")
        if raw is None:
            return None
        try:
            return ErrorReport.from_dict(raw)
        except ValueError as exc:
            raise SnapshotCorruptError(str(exc), file=self.file) from None


@dataclass(frozen=True)
class EncodedFile(EncodedInfo):
    """An encoded file's bytes (``data``) and checked layout."""

    data: np.ndarray
    layout: enc.EncodedLayout
    file: str | None

    def tensor(self, name: str) -> np.ndarray:
        stored = self.layout.by_name.get(name)
        if stored is None:
            raise SnapshotCorruptError("missing from the encoded file", file=self.file, tensor=name)
        return self.data[stored.begin : stored.end]

    def typed(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The bytes of tensor ``name``, refused unless it is stored as ``dtype`` ``shape``."""
        stored = self.layout.by_name.get(name)
        if stored is None or stored.dtype != dtype or stored.shape != tuple(shape):
            found = "missing" if stored is None else f"stored as {stored.dtype} {stored.shape}"
            raise SnapshotCorruptError(
                f"{found}, expected {dtype} {tuple(shape)}", file=self.file, tensor=name
            )
        return self.tensor(name)


@dataclass(frozen=True)
class EncodedHeader(EncodedInfo):
    """An encoded file's checked layout, its header read alone (no tensor is read)."""

    layout: enc.EncodedLayout
    file: str | None


def read_header(path: str | os.PathLike[str]) -> EncodedHeader:
    """The header of the encoded file at ``path``: its encoding, sizes and recorded error
    (``SnapshotIOError`` when it cannot be read, the format's errors when it is no encoded
    file)."""
    file = os.fspath(path)
    try:
        with open(file, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            prefix = stream.read(8)
            header = prefix + stream.read(enc.header_length(prefix, size, file))
    except OSError as exc:
        raise SnapshotIOError(f"{file}: cannot read ({exc.strerror or exc})") from exc
    return EncodedHeader(enc.parse_header(header, size, file), file)
