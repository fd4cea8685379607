"""Writing an encoded snapshot: an ordinary snapshot file's tensors encoded, the fp8 error
measured against the original pages, the container (:mod:`kvsnap.format.encoded`) written
front to back and published with a rename."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from kvsnap._version import __version__
from kvsnap.encoded.original import OriginalFile, check_original, parse_original, read_local
from kvsnap.encoded.read import decode, is_encoded, parse_encoded
from kvsnap.encoding import fp8, lossless, measure
from kvsnap.encoding.report import ErrorReport
from kvsnap.errors import SnapshotIOError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_BYTES, SIGNATURE_TENSOR
from kvsnap.format.container import TensorEntry, is_layer_tensor
from kvsnap.format.hashing import block_digests, digest128, encode_trailer
from kvsnap.format.hashing import page_digests as fmt_page_digests
from kvsnap.format.signing import KeyRing

#: Layer dtypes fp8 quantizes (others are stored raw), as torch dtypes.
FP8_SOURCES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
#: Codec names recorded per encoding.
CODECS = {"fp8": fp8.NAME, "lossless": lossless.NAME}


@dataclass(frozen=True)
class EncodeResult:
    """What :func:`encode_file` wrote: the path, the encoding, the decoded file's and the
    encoded file's sizes, the seconds taken and the fp8 error report (``None`` otherwise)."""

    path: str
    encoding: str
    decoded_bytes: int
    stored_bytes: int
    seconds: float
    error: ErrorReport | None

    @property
    def ratio(self) -> float:
        """Decoded bytes per stored byte (2.0: half the size)."""
        return self.decoded_bytes / max(self.stored_bytes, 1)


@dataclass
class _Stored:
    """Tensors to store, in file order: (name, dtype, shape, bytes)."""

    items: list[tuple[str, str, tuple[int, ...], np.ndarray]]
    kinds: dict[str, str]
    originals: dict[str, torch.Tensor]
    decoded: dict[str, torch.Tensor]


def encoding_device() -> torch.device:
    """Where fp8 pages are quantized and their error measured: the GPU when there is one (the
    same torch ops, bit for bit the same values, far faster), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fp8_tensor(
    original: OriginalFile, entry: TensorEntry, counts: torch.Tensor, out: _Stored
) -> None:
    dtype = FP8_SOURCES[entry.dtype]
    host = torch.frombuffer(original.bytes_of(entry).copy(), dtype=dtype).reshape(entry.shape)
    pages = host.to(counts.device)
    quantized = fp8.quantize(pages, token_counts=counts)
    values = quantized.values.cpu().numpy().reshape(-1)
    out.items.append((entry.name, "F8_E4M3", entry.shape, values))
    scales = quantized.scales.cpu().numpy()
    out.items.append(
        (entry.name + enc.SCALES_SUFFIX, "F32", scales.shape, scales.view(np.uint8).reshape(-1))
    )
    out.kinds[entry.name] = "fp8"
    out.originals[entry.name] = pages
    out.decoded[entry.name] = fp8.dequantize(quantized.values, quantized.scales, dtype)


def _lossless_tensor(
    original: OriginalFile, entry: TensorEntry, executor: Executor | None, out: _Stored
) -> None:
    word = enc.ITEM_BYTES[entry.dtype]
    coded = lossless.encode_pages(
        np.ascontiguousarray(original.pages(entry)), word, executor=executor
    )
    if coded is None:
        out.items.append((entry.name, entry.dtype, entry.shape, original.bytes_of(entry)))
        out.kinds[entry.name] = "raw"
        return
    out.items.append((entry.name, "U8", (coded.stored_bytes,), coded.data))
    table = np.ascontiguousarray(coded.chunk_table, dtype="<u8")
    out.items.append(
        (entry.name + enc.CHUNKS_SUFFIX, "U64", table.shape, table.view(np.uint8).reshape(-1))
    )
    out.kinds[entry.name] = "lossless"


def _stored_tensors(original: OriginalFile, encoding: str, executor: Executor | None) -> _Stored:
    header = np.frombuffer(original.layout.header, dtype=np.uint8)
    out = _Stored([(enc.ORIGINAL_HEADER_TENSOR, "U8", (len(header),), header)], {}, {}, {})
    counts = torch.from_numpy(original.tokens_per_block()).to(encoding_device())
    for entry in original.layout.entries:
        if enc.is_padding(entry.name):
            continue
        if not is_layer_tensor(entry.name):
            out.items.append((entry.name, entry.dtype, entry.shape, original.bytes_of(entry)))
        elif encoding == "fp8" and entry.dtype in FP8_SOURCES:
            _fp8_tensor(original, entry, counts, out)
        elif encoding == "lossless":
            _lossless_tensor(original, entry, executor, out)
        else:
            out.items.append((entry.name, entry.dtype, entry.shape, original.bytes_of(entry)))
            out.kinds[entry.name] = "raw"
    return out


def _with_page_checks(stored: _Stored, signed: bool) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """``stored``'s items with each fp8 tensor's page checks after its scales: the xxh3-64 of
    every stored page, and (``signed``) its BLAKE3-256."""
    items = []
    for name, dtype, shape, array in stored.items:
        items.append((name, dtype, shape, array))
        layer = name.removesuffix(enc.SCALES_SUFFIX)
        if name == layer or stored.kinds.get(layer) != "fp8":
            continue
        values = next(item[3] for item in stored.items if item[0] == layer)
        blocks = shape[0]
        page_bytes = len(values) // max(blocks, 1)
        pages = np.ascontiguousarray(block_digests(values, page_bytes), dtype="<u8")
        items.append((layer + enc.PAGES_SUFFIX, "U64", (blocks,), pages.view(np.uint8)))
        if signed:
            digests = fmt_page_digests(values, page_bytes)
            items.append((layer + enc.DIGESTS_SUFFIX, "U8", digests.shape, digests.reshape(-1)))
    return items


def encoded_pieces(
    original: OriginalFile,
    encoding: str,
    *,
    keys: KeyRing | None = None,
    measure_error: bool = True,
    executor: Executor | None = None,
) -> tuple[list[bytes | np.ndarray], ErrorReport | None]:
    """The bytes of the encoded file of ``original``, as pieces in file order, and the fp8
    error report (measured when ``measure_error``)."""
    if encoding not in enc.ENCODINGS:
        raise ValueError(f"encoding {encoding!r}: one of {', '.join(enc.ENCODINGS)}")
    stored = _stored_tensors(original, encoding, executor)
    report = None
    if stored.originals and measure_error:
        report = measure.error_report(
            stored.originals,
            stored.decoded,
            encoding=fp8.NAME,
            granularity="block-head",
            token_counts=torch.from_numpy(original.tokens_per_block()).to(encoding_device()),
        )
    items = _with_page_checks(stored, signed=keys is not None)
    # fp8 pages carry checks a device restore verifies; lossless ones decode on the host.
    checks = [] if encoding != "fp8" else ["xxh3-64"] if keys is None else list(enc.PAGE_CHECKS)
    algorithm = enc.PAGES_SIGNATURE_ALGORITHM if checks else enc.SIGNATURE_ALGORITHM
    document: dict[str, Any] = {
        "format_version": enc.ENCODED_FORMAT_VERSION,
        "kvsnap_version": __version__,
        "encoding": {
            "name": encoding,
            "codec": CODECS[encoding],
            "decoded_bytes": len(original.data),
            "tensors": stored.kinds,
            "signature": None if keys is None else algorithm,
            "error": None if report is None else report.to_dict(),
            **({"page_checks": checks} if checks else {}),
        },
    }
    return _container(document, items, keys), report


def _container(
    document: dict[str, Any],
    items: list[tuple[str, str, tuple[int, ...], Any]],
    keys: KeyRing | None,
) -> list[bytes | np.ndarray]:
    """The encoded file holding ``items`` (name, dtype, shape, bytes) under ``document``, as
    pieces in file order: its trailer, and with ``keys`` its signature, computed here."""
    specs = [(name, dtype, shape) for name, dtype, shape, _ in items]
    specs.append((enc.ENCODED_CHECKSUMS_TENSOR, "U8", (len(items) + 2, 16)))
    if keys is not None:
        specs.append((SIGNATURE_TENSOR, "U8", (SIGNATURE_BYTES,)))
    header, layout = enc.build_layout(document, specs)
    data = {name: array for name, _, _, array in items}
    digests = [digest128(header)] + [digest128(data[t.name]) for t in layout.checksummed]
    data[enc.ENCODED_CHECKSUMS_TENSOR] = trailer = encode_trailer(digests)
    pieces: list[bytes | np.ndarray] = [header]
    for tensor in layout.tensors:
        if enc.is_padding(tensor.name):
            pieces.append(bytes(tensor.nbytes))
        elif tensor.name == SIGNATURE_TENSOR and keys is not None:
            algorithm = document["encoding"]["signature"]
            names = enc.signed_names(layout, algorithm)
            signed = [blake3.blake3(_bytes(data[name])).digest() for name in names]
            pieces.append(keys.sign(enc.signed_message(header, signed), algorithm))
        elif tensor.name == enc.ENCODED_CHECKSUMS_TENSOR:
            pieces.append(trailer)
        else:
            pieces.append(data[tensor.name])
    return pieces


def _bytes(piece: bytes | np.ndarray) -> bytes | memoryview:
    return piece if isinstance(piece, bytes) else np.ascontiguousarray(piece).data.cast("B")


def _publish(pieces: list[bytes | np.ndarray], target: Path) -> int:
    """Write ``pieces`` to a temporary file beside ``target``, fsync, rename: the previous
    file at ``target`` is untouched on any error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    written = 0
    try:
        with os.fdopen(fd, "wb") as stream:
            for piece in pieces:
                raw = piece if isinstance(piece, bytes) else np.ascontiguousarray(piece).data
                stream.write(raw)
                written += len(piece) if isinstance(piece, bytes) else piece.nbytes
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except OSError as exc:
        Path(temporary).unlink(missing_ok=True)
        raise SnapshotIOError(f"{target}: cannot write the encoded snapshot ({exc})") from exc
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return written


def encode_file(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    encoding: str,
    *,
    keys: KeyRing | None = None,
    measure_error: bool = True,
    threads: int = 2,
) -> EncodeResult:
    """Encode the single-file snapshot ``source`` (checked first: nothing corrupt is encoded)
    into ``target`` with ``encoding`` (``"lossless"`` or ``"fp8"``), signed with ``keys``'
    first key when given. Chunks are coded on ``threads`` threads."""
    started = time.perf_counter()
    original = parse_original(read_local(source), os.fspath(source))
    check_original(original)
    with ThreadPoolExecutor(max(1, threads)) as executor:
        pieces, report = encoded_pieces(
            original, encoding, keys=keys, measure_error=measure_error, executor=executor
        )
    stored = _publish(pieces, Path(target))
    return EncodeResult(
        os.fspath(target),
        encoding,
        len(original.data),
        stored,
        time.perf_counter() - started,
        report,
    )


def recode_file(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    compression: str,
    *,
    keys: KeyRing | None = None,
    measure_error: bool = True,
    threads: int = 2,
) -> EncodeResult:
    """Write the snapshot ``source`` (ordinary or encoded: an encoded one is decoded first)
    to ``target`` as ``compression``: ``"none"`` (the ordinary file), ``"lossless"`` or
    ``"fp8"``. An fp8 snapshot re-encoded is measured against its decoded pages, not the
    pages it was made from (those are gone)."""
    if compression not in ("none", *enc.ENCODINGS):
        raise ValueError(f"compression {compression!r}: none, lossless or fp8")
    started = time.perf_counter()
    data = read_local(source)
    if is_encoded(data):
        with ThreadPoolExecutor(max(1, threads)) as executor:
            data = decode(parse_encoded(data, os.fspath(source)), executor)
    original = parse_original(data, os.fspath(source))
    check_original(original)
    if compression == "none":
        if keys is not None and original.metadata.signature is None:
            raise ValueError(
                "an ordinary snapshot is signed at capture: --compress none keeps "
                "the file as it was"
            )
        stored = _publish([data], Path(target))
        report = None
    else:
        with ThreadPoolExecutor(max(1, threads)) as executor:
            pieces, report = encoded_pieces(
                original, compression, keys=keys, measure_error=measure_error, executor=executor
            )
        stored = _publish(pieces, Path(target))
    return EncodeResult(
        os.fspath(target), compression, len(data), stored, time.perf_counter() - started, report
    )


def capture_encoded(
    capture: Callable[[str], Any],
    path: str | os.PathLike[str],
    compression: str,
    *,
    keys: KeyRing | None,
    refused: bool,
) -> Any:
    """``capture(written)`` into a temporary file beside ``path`` (unsigned: the encoded file
    is what is signed), then that file encoded into ``path`` as ``compression`` and removed:
    the capture's result, its path ``path``."""
    if compression not in enc.ENCODINGS:
        raise ValueError(f"compression {compression!r}: none, lossless or fp8")
    if refused or "://" in os.fspath(path):
        raise ValueError("an encoded snapshot is one local file: no shards, parts or URLs")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    written = target.with_name(f".{target.name}.captured.tmp")
    try:
        result = capture(str(written))
        recode_file(written, target, compression, keys=keys)
    finally:
        written.unlink(missing_ok=True)
    return dataclasses.replace(result, path=os.fspath(path))
