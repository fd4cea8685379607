"""Writing an encoded snapshot: an ordinary snapshot file's tensors encoded
(:mod:`kvsnap.encoded.stored`), the fp8 error measured against the original pages, the
container (:mod:`kvsnap.format.encoded`) written front to back and published with a rename."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from kvsnap._version import __version__
from kvsnap.encoded.file import EncodedFile
from kvsnap.encoded.kept import KeptFp8, kept_fp8
from kvsnap.encoded.original import OriginalFile, check_original, parse_original, read_local
from kvsnap.encoded.read import decode, is_encoded, parse_encoded
from kvsnap.encoded.stored import (
    CODECS,
    FP8_SOURCES,
    StoredTensors,
    add_fp8,
    add_lossless,
    add_raw,
    encoding_device,
    with_page_checks,
)
from kvsnap.encoded.unsigned import check_original_signature, encodable, unkeyed
from kvsnap.encoding import fp8, measure
from kvsnap.encoding.report import ErrorReport
from kvsnap.errors import SnapshotIOError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.container import SIGNATURE_SPEC, TensorEntry, is_layer_tensor
from kvsnap.format.hashing import digest128, encode_trailer
from kvsnap.format.signing import KeyRing


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
    #: What the caller should know of the file written (an unsigned file from a signed one).
    notes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """Decoded bytes per stored byte (2.0: half the size)."""
        return self.decoded_bytes / max(self.stored_bytes, 1)


def _fp8_tensor(
    original: OriginalFile, entry: TensorEntry, counts: torch.Tensor, out: StoredTensors
) -> None:
    dtype = FP8_SOURCES[entry.dtype]
    host = torch.frombuffer(original.bytes_of(entry).copy(), dtype=dtype).reshape(entry.shape)
    add_fp8(out, entry, host.to(counts.device), counts)


def _stored_tensors(
    original: OriginalFile, encoding: str, executor: Executor | None
) -> StoredTensors:
    header = np.frombuffer(original.layout.header, dtype=np.uint8)
    out = StoredTensors([(enc.ORIGINAL_HEADER_TENSOR, "U8", (len(header),), header)])
    counts = torch.from_numpy(original.tokens_per_block()).to(encoding_device())
    for entry in original.layout.entries:
        if enc.is_padding(entry.name):
            continue
        if not is_layer_tensor(entry.name):
            out.items.append((entry.name, entry.dtype, entry.shape, original.bytes_of(entry)))
        elif encoding == "fp8" and entry.dtype in FP8_SOURCES:
            _fp8_tensor(original, entry, counts, out)
        elif encoding == "lossless":
            pages = np.ascontiguousarray(original.pages(entry))
            add_lossless(out, entry, pages, executor)
        else:
            add_raw(out, entry, original.bytes_of(entry))
    return out


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
    return stored_pieces(stored, encoding, len(original.data), keys, report), report


def stored_pieces(
    stored: StoredTensors,
    encoding: str,
    decoded_bytes: int,
    keys: KeyRing | None,
    report: ErrorReport | None,
) -> list[bytes | np.ndarray]:
    """The encoded file (``encoding``) of a decoded file of ``decoded_bytes`` whose tensors
    ``stored`` holds, with the fp8 pages' checks, its metadata recording ``report``, and
    signed with ``keys``' first key when given: pieces in file order."""
    header, layout, data = stored_file(stored, encoding, decoded_bytes, keys, report)
    pieces = container_pieces(header, layout, data, keys, stored.digests)
    return [header, *(piece for _, piece in pieces)]


def stored_file(
    stored: StoredTensors,
    encoding: str,
    decoded_bytes: int,
    keys: KeyRing | None,
    report: ErrorReport | None,
) -> tuple[bytes, enc.EncodedLayout, dict[str, bytes | np.ndarray | None]]:
    """:func:`stored_pieces`' file before its trailer and signature: its header, its layout
    and every stored tensor's bytes by name (``None`` for tensors written elsewhere)."""
    items = with_page_checks(stored, signed=keys is not None)
    document = encoded_document(encoding, stored.kinds, decoded_bytes, keys, report)
    specs = container_specs([(name, dtype, shape) for name, dtype, shape, _ in items], keys)
    header, layout = enc.build_layout(document, specs)
    return header, layout, {name: array for name, _, _, array in items}


def encoded_document(
    encoding: str,
    kinds: Mapping[str, str],
    decoded_bytes: int,
    keys: KeyRing | None,
    report: ErrorReport | None,
) -> dict[str, Any]:
    """The kvsnap metadata of an encoded file (``encoding``) storing each layer tensor as
    ``kinds`` says, of a decoded file of ``decoded_bytes``, signed when ``keys`` are given,
    recording ``report``."""
    # fp8 pages carry checks a device restore verifies; lossless ones decode on the host.
    checks = [] if encoding != "fp8" else ["xxh3-64"] if keys is None else list(enc.PAGE_CHECKS)
    algorithm = enc.PAGES_SIGNATURE_ALGORITHM if checks else enc.SIGNATURE_ALGORITHM
    return {
        "format_version": enc.ENCODED_FORMAT_VERSION,
        "kvsnap_version": __version__,
        "encoding": {
            "name": encoding,
            "codec": CODECS[encoding],
            "decoded_bytes": decoded_bytes,
            "tensors": dict(kinds),
            "signature": None if keys is None else algorithm,
            "error": None if report is None else report.to_dict(),
            **({"page_checks": checks} if checks else {}),
        },
    }


def container_specs(
    specs: list[tuple[str, str, tuple[int, ...]]], keys: KeyRing | None
) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every tensor spec of an encoded file storing ``specs``: theirs, the trailer's, and with
    ``keys`` the signature's."""
    specs = [*specs, (enc.ENCODED_CHECKSUMS_TENSOR, "U8", (len(specs) + 2, 16))]
    if keys is not None:
        specs.append((SIGNATURE_SPEC.name, SIGNATURE_SPEC.dtype, SIGNATURE_SPEC.shape))
    return specs


def container_pieces(
    header: bytes,
    layout: enc.EncodedLayout,
    data: Mapping[str, bytes | np.ndarray | None],
    keys: KeyRing | None,
    known: Mapping[str, Future[bytes]] | None = None,
) -> list[tuple[enc.StoredTensor, bytes | np.ndarray | None]]:
    """Each tensor of the encoded file ``layout`` (its header ``header``) after the header,
    with its bytes: ``data``'s, the padding's, the trailer (from the xxh3-128 digests
    ``known`` holds, hashed ahead, and those of the rest) and with ``keys`` the signature.
    A tensor ``data`` holds as ``None`` is written elsewhere: its digest must be ``known``,
    and the signature must not cover it."""
    known = known or {}
    digests = [digest128(header)]
    for tensor in layout.checksummed:
        ahead = known.get(tensor.name)
        digests.append(ahead.result() if ahead is not None else digest128(_held(data, tensor)))
    trailer = encode_trailer(digests)
    pieces: list[tuple[enc.StoredTensor, bytes | np.ndarray | None]] = []
    for tensor in layout.tensors:
        if enc.is_padding(tensor.name):
            pieces.append((tensor, bytes(tensor.nbytes)))
        elif tensor.name == SIGNATURE_TENSOR and keys is not None:
            algorithm = layout.document["encoding"]["signature"]
            with_trailer = {**data, enc.ENCODED_CHECKSUMS_TENSOR: trailer}
            signed = [
                blake3.blake3(_bytes(_held(with_trailer, layout.by_name[name]))).digest()
                for name in enc.signed_names(layout, algorithm)
            ]
            pieces.append((tensor, keys.sign(enc.signed_message(header, signed), algorithm)))
        elif tensor.name == enc.ENCODED_CHECKSUMS_TENSOR:
            pieces.append((tensor, trailer))
        else:
            pieces.append((tensor, data[tensor.name]))
    return pieces


def _held(
    data: Mapping[str, bytes | np.ndarray | None], tensor: enc.StoredTensor
) -> bytes | np.ndarray:
    held = data[tensor.name]
    if held is None:
        raise ValueError(f"{tensor.name}: written elsewhere, yet needed here")
    return held


def _bytes(piece: bytes | np.ndarray) -> bytes | memoryview:
    return piece if isinstance(piece, bytes) else np.ascontiguousarray(piece).data.cast("B")


def publish(pieces: list[bytes | np.ndarray], target: Path) -> int:
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
    first key when given. A signed ``source`` needs ``keys``: its signature is checked with
    them and the unsigned file it stands for is encoded (:mod:`kvsnap.encoded.unsigned`).
    Chunks are coded on ``threads`` threads."""
    started = time.perf_counter()
    original = parse_original(read_local(source), os.fspath(source))
    check_original(original)
    original = encodable(original, keys)
    with ThreadPoolExecutor(max(1, threads)) as executor:
        pieces, report = encoded_pieces(
            original, encoding, keys=keys, measure_error=measure_error, executor=executor
        )
    stored = publish(pieces, Path(target))
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
    ``"fp8"``. An fp8 snapshot written as fp8 is kept, not quantized again
    (:mod:`kvsnap.encoded.kept`: its values, scales and recorded error as they are); written
    as anything else, it gives its decoded values, without the error it records against the
    captured pages, which ``notes`` says. A signed ``source`` has its signature checked
    when ``keys`` are given, and is encoded only with them (as :func:`encode_file` says). A
    signed encoded ``source`` written as ``"none"`` gives its decoded file, unsigned by design
    (an ordinary file is signed at capture), which ``notes`` says; an unsigned ``source`` is
    refused ``"none"`` with ``keys`` (``ValueError``): nothing is checked or signed."""
    if compression not in ("none", *enc.ENCODINGS):
        raise ValueError(f"compression {compression!r}: none, lossless or fp8")
    started = time.perf_counter()
    data = read_local(source)
    file, written = os.fspath(source), os.fspath(target)
    signed_encoded = False
    notes: tuple[str, ...] = ()
    if is_encoded(data):
        encoded = EncodedFile(data, _layout(data, file), file)
        if encoded.encoding["name"] == "fp8" and compression == "fp8":
            return _write_kept(kept_fp8(encoded, written, keys, threads), written, keys, started)
        notes = _decoded_notes(encoded, written, compression)
        data, signed_encoded = _decoded(encoded, compression, keys, threads)
    original = parse_original(data, file)
    check_original(original)
    if compression == "none":
        notes += _plain_copy_notes(original, keys, signed_encoded, written)
        stored = publish([data], Path(target))
        report = None
    else:
        original = encodable(original, keys)
        with ThreadPoolExecutor(max(1, threads)) as executor:
            pieces, report = encoded_pieces(
                original, compression, keys=keys, measure_error=measure_error, executor=executor
            )
        stored = publish(pieces, Path(target))
    seconds = time.perf_counter() - started
    return EncodeResult(written, compression, len(original.data), stored, seconds, report, notes)


def _write_kept(kept: KeptFp8, target: str, keys: KeyRing | None, started: float) -> EncodeResult:
    """Write the fp8 file ``kept`` keeps to ``target``: as it is, or its tensors signed."""
    decoded_bytes = kept.encoded.decoded_bytes
    if kept.stored is None:
        pieces: list[bytes | np.ndarray] = [kept.encoded.data]
    else:
        pieces = stored_pieces(kept.stored, "fp8", decoded_bytes, keys, kept.report)
    stored = publish(pieces, Path(target))
    seconds = time.perf_counter() - started
    return EncodeResult(target, "fp8", decoded_bytes, stored, seconds, kept.report, kept.notes)


def _decoded_notes(encoded: EncodedFile, target: str, compression: str) -> tuple[str, ...]:
    """What writing the encoded file ``encoded`` decoded (``"none"``) or ``"lossless"`` to
    ``target`` loses: an fp8 file's recorded error, which is of its values against the
    captured pages, gone (the values written are the decoded ones, exactly)."""
    if encoded.encoding["name"] != "fp8":
        return ()
    held = "its decoded file" if compression == "none" else "its decoded values, bit for bit"
    return (
        f"{encoded.file} is fp8: {target} holds {held}; the error {encoded.file} records "
        "(against the pages it was made from, which are gone) is not carried",
    )


def _plain_copy_notes(
    original: OriginalFile, keys: KeyRing | None, signed_encoded: bool, target: str
) -> tuple[str, ...]:
    """Check what ``keys`` can check before ``original`` is written as it is (a signed file's
    signature; a signed encoded file's was checked as it was decoded) and say what the file
    written is; refuse (``ValueError``) ``keys`` given for a source that no key signed."""
    if keys is None:
        return ()
    if original.metadata.signature is not None:
        check_original_signature(original, keys)
        return ()
    if not signed_encoded:
        raise ValueError(
            f"{original.file} is not signed: there is no signature for --key-file to check, "
            "and --compress none signs nothing (an ordinary snapshot is signed at capture: "
            "kvsnap capture --key-file; an encoded one with --compress lossless --key-file)"
        )
    return (
        f"{target} is unsigned: the encoded file's signature (checked with the key) covers "
        "that file only, and an ordinary snapshot is signed at capture; for a signed copy, "
        "--compress lossless --key-file (bit-exact)",
    )


def _layout(data: np.ndarray, file: str) -> enc.EncodedLayout:
    length = enc.header_length(data[:8].tobytes(), len(data), file)
    return enc.parse_header(data[: 8 + length].tobytes(), len(data), file)


def _decoded(
    encoded: EncodedFile, compression: str, keys: KeyRing | None, threads: int
) -> tuple[np.ndarray, bool]:
    """The decoded file of ``encoded`` (its container parsed), checked, and whether it is
    signed: signed, its signature is checked with ``keys``, and it is encoded again only with
    them."""
    signed = encoded.encoding.get("signature") is not None
    if signed and keys is None and compression != "none":
        raise unkeyed(encoded.file)
    checked = parse_encoded(encoded.data, encoded.file, keys if signed else None)
    with ThreadPoolExecutor(max(1, threads)) as executor:
        return decode(checked, executor), signed


def check_compression(compression: str, path: str | os.PathLike[str], refused: bool) -> None:
    """Refuse (``ValueError``) a capture's ``compression`` that is no encoding, and an encoded
    capture to anything but one local file (``refused``: shards or parts were asked for)."""
    if compression not in enc.ENCODINGS:
        raise ValueError(f"compression {compression!r}: none, lossless or fp8")
    if refused or "://" in os.fspath(path):
        raise ValueError("an encoded snapshot is one local file: no shards, parts or URLs")


def capture_encoded(
    capture: Callable[[str], Any],
    path: str | os.PathLike[str],
    compression: str,
    *,
    keys: KeyRing | None,
    refused: bool,
) -> Any:
    """``capture(written)`` into a temporary file beside ``path`` (an ordinary snapshot; a
    signed one is checked with ``keys`` and its unsigned form encoded, as :func:`recode_file`
    does), then that file encoded into ``path`` as ``compression`` (signed with ``keys``) and
    removed: the capture's result, its path ``path``, its bytes the encoded file's and its
    seconds the whole call's. The way an encoded capture goes where its pages cannot be
    gathered on the device (:mod:`kvsnap.encoded.capture`)."""
    check_compression(compression, path, refused)
    started = time.perf_counter()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    written = target.with_name(f".{target.name}.captured.tmp")
    try:
        result = capture(str(written))
        encoded = recode_file(written, target, compression, keys=keys)
    finally:
        written.unlink(missing_ok=True)
    return dataclasses.replace(
        result,
        path=os.fspath(path),
        num_bytes=encoded.stored_bytes,
        seconds=time.perf_counter() - started,
    )
