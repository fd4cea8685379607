"""Encoded snapshot files rewritten by someone who can write them and recompute every checksum
but holds no key: one field is wrong, the container around it (header, offsets, padding,
trailer) consistent, so that the check of that field, not the trailer, is what refuses the
file. Rebuilt with kvsnap's own container code (kvsnap/format/encoded.py,
kvsnap/encoded/write.py), as a careless or hostile writer using kvsnap would."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.encoded.write import container_pieces, container_specs
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR


@dataclass
class StoredParts:
    """An encoded file's kvsnap document and its tensors but padding, the trailer and the
    signature (kept apart, unchecked by a reader without keys), in file order."""

    document: dict[str, Any]
    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]]
    signature: np.ndarray | None

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes (a view: change them in place)."""
        return next(data for stored, _, _, data in self.tensors if stored == name)

    def replace(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray) -> None:
        """Store ``data`` as tensor ``name`` of ``dtype`` and ``shape`` instead."""
        index = next(i for i, (stored, *_) in enumerate(self.tensors) if stored == name)
        self.tensors[index] = (name, dtype, shape, np.ascontiguousarray(data).view(np.uint8))


def stored_parts(path: Path) -> StoredParts:
    data = np.fromfile(path, dtype=np.uint8)
    length = enc.header_length(data[:8].tobytes(), len(data))
    layout = enc.parse_header(data[: 8 + length].tobytes(), len(data))
    tensors = [(t.name, t.dtype, t.shape, data[t.begin : t.end].copy()) for t in layout.checksummed]
    signature = layout.by_name.get(SIGNATURE_TENSOR)
    held = None if signature is None else data[signature.begin : signature.end].copy()
    return StoredParts(json.loads(json.dumps(layout.document)), tensors, held)


def write_parts(parts: StoredParts, path: Path) -> Path:
    """The encoded file of ``parts`` at ``path``: laid out, padded and checksummed as kvsnap
    lays out any encoded file; a signature kept as it was (now stale)."""
    specs = container_specs([(name, dtype, shape) for name, dtype, shape, _ in parts.tensors], None)
    data: dict[str, bytes | np.ndarray | None] = {name: a for name, _, _, a in parts.tensors}
    if parts.signature is not None:
        specs.append((SIGNATURE_TENSOR, "U8", (len(parts.signature),)))
        data[SIGNATURE_TENSOR] = parts.signature
    header, layout = enc.build_layout(parts.document, specs)
    with open(path, "wb") as stream:
        stream.write(header)
        for _, piece in container_pieces(header, layout, data, None):
            assert piece is not None
            stream.write(piece if isinstance(piece, bytes) else piece.tobytes())
    return path


def original_header(parts: StoredParts) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The decoded file's header kept in ``parts``: its entries (``__metadata__`` included),
    its kvsnap metadata, and its JSON's length (the bytes between the prefix and the data)."""
    raw = parts.array(enc.ORIGINAL_HEADER_TENSOR).tobytes()
    (length,) = struct.unpack("<Q", raw[:8])
    entries = json.loads(raw[8 : 8 + length])
    return entries, json.loads(entries["__metadata__"]["kvsnap"]), length


def set_original_metadata(parts: StoredParts, metadata: dict[str, Any]) -> None:
    """Put ``metadata`` in the decoded file's header kept in ``parts``, at the same length
    (the header's space padding takes the difference)."""
    entries, _, length = original_header(parts)
    entries["__metadata__"]["kvsnap"] = json.dumps(metadata, separators=(",", ":"))
    text = json.dumps(entries, separators=(",", ":")).encode()
    assert len(text) <= length, "the new metadata does not fit the header's padding"
    raw = struct.pack("<Q", length) + text + b" " * (length - len(text))
    parts.array(enc.ORIGINAL_HEADER_TENSOR)[:] = np.frombuffer(raw, dtype=np.uint8)
