"""What ``inspect`` and ``store list`` say about a snapshot's encoding, and ``verify --against``'s
new measurement of an fp8 snapshot's error."""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

import numpy as np

from kvsnap.encoded.file import EncodedInfo
from kvsnap.errors import KVSnapError
from kvsnap.format import encoded as enc


class _Readable(Protocol):
    """What a measurement reads of a snapshot (``kvsnap.Snapshot`` has it)."""

    @property
    def num_blocks(self) -> int: ...

    def read_tensor(self, name: str) -> Any: ...

    def valid_tokens_per_block(self) -> np.ndarray: ...


def encoding_summary(encoded: EncodedInfo | None) -> dict[str, Any]:
    """``{"name": "none"}`` for an ordinary file; else the encoding's name and codec, the
    decoded and stored sizes, their ratio, how many layer tensors each way is stored, and the
    recorded error (its worst values and the full report, or ``None``)."""
    if encoded is None:
        return {"name": "none"}
    encoding = encoded.encoding
    kinds = list(encoding["tensors"].values())
    error = encoded.error
    return {
        "name": encoding["name"],
        "codec": encoding["codec"],
        "format_version": encoded.layout.document["format_version"],
        "decoded_bytes": encoded.decoded_bytes,
        "stored_bytes": encoded.layout.file_size,
        "ratio": round(encoded.ratio, 4),
        "tensors": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
        "error": None if error is None else {"worst": error.worst, "report": error.to_dict()},
    }


def error_line(worst: dict[str, float]) -> str:
    """An error report's worst values in one line."""
    return (
        f"max abs {worst['max_abs']:.4g} ({100 * worst['max_abs_rel_block']:.2f}% of a block's "
        f"max), RMS rel {100 * worst['rms_rel']:.2f}%, min cosine {worst['min_cosine']:.5f}, "
        f"underflow {100 * worst['underflow_share']:.3f}%, non-finite {int(worst['non_finite'])}"
        f", attention rel L2 {100 * worst['attention_rel_l2']:.2f}% "
        f"(min cosine {worst['attention_min_cosine']:.5f})"
    )


def measured_error(decoded: _Readable, original: _Readable, names: list[str], encoding: str) -> Any:
    """The error report of ``decoded`` (an fp8 snapshot, opened) against ``original``,
    measured as the encoder did (:func:`kvsnap.encoding.measure.error_report`)."""
    import torch

    from kvsnap.encoding import measure

    return measure.error_report(
        {name: original.read_tensor(name) for name in names},
        {name: decoded.read_tensor(name) for name in names},
        encoding=encoding,
        granularity="block-head",
        token_counts=torch.from_numpy(original.valid_tokens_per_block()),
    )


def file_encoding(path: str) -> tuple[str, float]:
    """``(encoding, ratio)`` of the snapshot file at ``path`` from its header alone:
    ``("none", 1.0)`` for an ordinary file (or one that cannot be read), else the encoding's
    name and its decoded bytes over its size. The file's access time is left as it was (a
    prefix store's least recently used order reads it)."""
    try:
        header, size = _header_keeping_atime(path)
    except (OSError, ValueError, KVSnapError):
        return "none", 1.0
    if enc.peek_version(header) != enc.ENCODED_FORMAT_VERSION:
        return "none", 1.0
    try:
        document = json.loads(json.loads(header[8:])["__metadata__"]["kvsnap"])
        encoding = document["encoding"]
        return str(encoding["name"]), int(encoding["decoded_bytes"]) / max(size, 1)
    except (ValueError, KeyError, TypeError):
        return "none", 1.0


def _header_keeping_atime(path: str) -> tuple[bytes, int]:
    """The first ``8 + N`` bytes of the file at ``path`` and its size, read with ``O_NOATIME``
    where this process may (it owns the file), else with the access time put back."""
    before = os.stat(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
        restore = False
    except PermissionError:
        fd, restore = os.open(path, os.O_RDONLY), True
    try:
        prefix = os.pread(fd, 8, 0)
        length = enc.header_length(prefix, before.st_size, path)
        header = prefix + os.pread(fd, length, 8)
    finally:
        os.close(fd)
        if restore:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return header, before.st_size


#: How far a number measured again may be from the one recorded: the report keeps 6 digits,
#: and a GPU's sums run in another order than the CPU's.
REPORT_TOLERANCE = 1e-3


def reports_agree(measured: Any, recorded: Any, tolerance: float = REPORT_TOLERANCE) -> bool:
    """Whether two error reports (``to_dict`` form) say the same: the same fields, strings and
    counts, every other number within ``tolerance`` relative (or 1e-9 absolute)."""
    if isinstance(measured, dict) and isinstance(recorded, dict):
        return measured.keys() == recorded.keys() and all(
            reports_agree(measured[key], recorded[key], tolerance) for key in measured
        )
    if isinstance(measured, list) and isinstance(recorded, list):
        return len(measured) == len(recorded) and all(
            reports_agree(a, b, tolerance) for a, b in zip(measured, recorded, strict=True)
        )
    if isinstance(measured, float) or isinstance(recorded, float):
        scale = max(abs(measured), abs(recorded))
        return abs(measured - recorded) <= max(tolerance * scale, 1e-9)
    return bool(measured == recorded)
