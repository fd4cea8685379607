"""An encoded file's bytes and checked layout: its tensors' bytes by name, its encoding and its
recorded error report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap.encoding.report import ErrorReport
from kvsnap.errors import SnapshotCorruptError
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
