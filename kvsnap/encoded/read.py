"""Reading an encoded snapshot: its container checked (trailer, padding, signature, the tensors
its metadata requires and nothing else), then decoded into the ordinary file it stands for.

A lossless decode is bit-exact and proved so: the decoded file is the original byte for byte,
checked against the original's own page checksums and trailer. An fp8 decode is a new
ordinary file of the same layout whose pages are the dequantized ones: its page checksums,
page digests and trailer are computed for those pages, its signature left zero (the encoded
file's own signature is what vouches for it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import blake3
import numpy as np

from kvsnap import format as fmt
from kvsnap.encoded.file import EncodedFile
from kvsnap.encoded.original import (
    NUMPY_TYPES,
    OriginalFile,
    check_layer_pages,
    check_trailer,
    described_file,
    parse_original,
    read_local,
    stored_block_checksums,
    trailer_digests,
)
from kvsnap.encoding import lossless
from kvsnap.errors import BadSignatureError, SnapshotCorruptError, UnsignedSnapshotError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.container import (
    SIGNATURE_SPEC,
    TensorEntry,
    check_declared_as,
    is_layer_tensor,
)
from kvsnap.format.hashing import (
    block_digests,
    decode_trailer,
    digest128,
    encode_trailer,
    page_digests,
)
from kvsnap.format.signing import KeyRing


def is_encoded(data: np.ndarray) -> bool:
    """Whether the file held in ``data`` declares itself an encoded snapshot."""
    if len(data) < 8:
        return False
    length = int(data[:8].view("<u8")[0])
    if length > enc.MAX_HEADER_BYTES or 8 + length > len(data):
        return False
    return enc.peek_version(data[: 8 + length].tobytes()) == enc.ENCODED_FORMAT_VERSION


def parse_encoded(
    data: np.ndarray, file: str | None = None, keys: KeyRing | None = None
) -> EncodedFile:
    """The encoded file held in ``data``, checked: header, trailer (every stored byte), zero
    padding, and with ``keys`` its signature."""
    length = enc.header_length(data[:8].tobytes(), len(data), file)
    header = data[: 8 + length].tobytes()
    encoded = EncodedFile(data, enc.parse_header(header, len(data), file), file)
    checked = encoded.layout.checksummed
    rows = decode_trailer(encoded.tensor(enc.ENCODED_CHECKSUMS_TENSOR).tobytes(), file)
    if len(rows) != len(checked) + 1 or rows[0] != digest128(header):
        raise SnapshotCorruptError("header checksum mismatch", file=file)
    for row, stored in zip(rows[1:], checked, strict=True):
        if digest128(encoded.tensor(stored.name)) != row:
            raise SnapshotCorruptError("checksum mismatch", file=file, tensor=stored.name)
    for stored in encoded.layout.tensors:
        if enc.is_padding(stored.name) and encoded.tensor(stored.name).any():
            raise SnapshotCorruptError("padding is not zero", file=file, tensor=stored.name)
    check_signature(encoded, header, keys)
    return encoded


def check_signature(encoded: EncodedFile, header: bytes, keys: KeyRing | None) -> None:
    """Refuse an encoded file (its ``header`` the bytes before its data) whose signature fields
    disagree, and with ``keys`` one they do not vouch for (``UnsignedSnapshotError``,
    ``BadSignatureError``) or whose fp8 pages differ from their signed digests."""
    algorithm = check_signature_fields(encoded.layout, encoded.file)
    if keys is None:
        return
    check_signed_message(encoded.layout, header, encoded.tensor, keys, encoded.file)
    if algorithm == enc.PAGES_SIGNATURE_ALGORITHM:
        for name in encoded.layout.fp8_names():
            check_pages(encoded, name, enc.DIGESTS_SUFFIX)


def check_signature_fields(layout: enc.EncodedLayout, file: str | None) -> str | None:
    """The file's signature algorithm, refused unless it agrees with the signature tensor and
    with the page checks the file carries, and that tensor is an ordinary signed file's
    (``U8 (48,)``: read without keys too, for the key id ``inspect`` shows)."""
    algorithm = layout.encoding.get("signature")
    signature = layout.by_name.get(SIGNATURE_TENSOR)
    has_tensor = signature is not None
    expected = enc.PAGES_SIGNATURE_ALGORITHM if layout.page_checks else enc.SIGNATURE_ALGORITHM
    signed_checks = "blake3" in layout.page_checks
    if (
        (algorithm is not None) != has_tensor
        or algorithm not in (None, expected)
        or signed_checks != (algorithm == enc.PAGES_SIGNATURE_ALGORITHM)
    ):
        raise SnapshotCorruptError(f"signature {algorithm!r} and its tensors disagree", file=file)
    if signature is not None:
        check_declared_as(signature, SIGNATURE_SPEC, file)
    return algorithm


def check_signed_message(
    layout: enc.EncodedLayout,
    header: bytes,
    tensor: Callable[[str], np.ndarray],
    keys: KeyRing,
    file: str | None,
) -> None:
    """Refuse (``UnsignedSnapshotError``, ``BadSignatureError``) a file whose signature is not
    one of ``keys``' over its header and the tensors :func:`~kvsnap.format.encoded.signed_names`
    lists (read through ``tensor``)."""
    algorithm = layout.encoding.get("signature")
    if algorithm is None:
        raise UnsignedSnapshotError("the encoded snapshot is not signed", file=file)
    names = enc.signed_names(layout, algorithm)
    digests = [blake3.blake3(tensor(name).tobytes()).digest() for name in names]
    problem = keys.problem(
        enc.signed_message(header, digests), tensor(SIGNATURE_TENSOR).tobytes(), algorithm
    )
    if problem is not None:
        raise BadSignatureError(f"bad signature: {problem}", file=file)


def check_pages(encoded: EncodedFile, name: str, suffix: str) -> None:
    """Refuse an fp8 tensor whose pages differ from their stored xxh3-64 (``.pages``) or
    BLAKE3 (``.digests``), naming the first differing block."""
    shape = encoded.layout.by_name[name].shape
    values = encoded.tensor(name)
    checks = {stored[0]: stored for stored in companions(name, shape, encoded.layout.page_checks)}
    stored = encoded.typed(*checks[name + suffix])
    blocks = shape[0]
    page_bytes = len(values) // max(blocks, 1)
    if suffix == enc.PAGES_SUFFIX:
        ok = block_digests(values, page_bytes) == stored.view("<u8")
    else:
        ok = (page_digests(values, page_bytes) == stored.reshape(blocks, -1)).all(axis=1)
    if not ok.all():
        block = int(np.flatnonzero(~ok)[0])
        what = "checksum" if suffix == enc.PAGES_SUFFIX else "signed digest"
        raise SnapshotCorruptError(
            f"page {what} mismatch", file=encoded.file, tensor=name, block=block
        )


def read_encoded(path: str | os.PathLike[str], keys: KeyRing | None = None) -> EncodedFile:
    """The encoded snapshot at local ``path``, checked (:func:`parse_encoded`)."""
    return parse_encoded(read_local(path), os.fspath(path), keys)


def companions(
    name: str, shape: tuple[int, ...], page_checks: tuple[str, ...]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """An fp8 layer tensor of the decoded ``shape`` as stored, in file order: its values, its
    scales and the page checks ``page_checks`` lists, each ``(name, dtype, shape)``."""
    blocks = shape[0]
    heads = shape[2] if len(shape) == 4 else 1
    stored = [(name, "F8_E4M3", shape), (name + enc.SCALES_SUFFIX, "F32", (blocks, heads))]
    if "xxh3-64" in page_checks:
        stored.append((name + enc.PAGES_SUFFIX, "U64", (blocks,)))
    if "blake3" in page_checks:
        stored.append((name + enc.DIGESTS_SUFFIX, "U8", (blocks, 32)))
    return stored


def _expected_names(
    entries: Sequence[TensorEntry], kinds: dict[str, str], page_checks: tuple[str, ...]
) -> list[str]:
    names = [enc.ORIGINAL_HEADER_TENSOR]
    for entry in entries:
        if enc.is_padding(entry.name):
            continue
        names.append(entry.name)
        kind = kinds.get(entry.name)
        if kind == "fp8":
            names += [stored[0] for stored in companions(entry.name, entry.shape, page_checks)[1:]]
        elif kind == "lossless":
            names.append(entry.name + enc.CHUNKS_SUFFIX)
    return names


def _lossless_tensor(encoded: EncodedFile, entry: TensorEntry) -> lossless.LosslessTensor:
    """The stored chunks and chunk table of a layer tensor stored ``lossless``."""
    blocks = entry.shape[0]
    stored = encoded.layout.by_name[entry.name]
    data = encoded.typed(entry.name, "U8", stored.shape)
    table_entry = encoded.layout.by_name[entry.name + enc.CHUNKS_SUFFIX]
    if table_entry.dtype != "U64" or len(table_entry.shape) != 2:
        raise SnapshotCorruptError(
            "chunk table is not U64 (chunks, columns)", file=encoded.file, tensor=table_entry.name
        )
    table = encoded.tensor(table_entry.name).view("<u8").reshape(table_entry.shape)
    word = enc.ITEM_BYTES[entry.dtype]
    return lossless.LosslessTensor(
        word, entry.nbytes // max(blocks, 1), blocks, table.astype(np.uint64), data
    )


def _decode_layer(
    encoded: EncodedFile, entry: TensorEntry, kind: str, out: np.ndarray, executor: Executor | None
) -> None:
    """One layer tensor of a file holding fp8 tensors decoded into ``out``."""
    if kind == "raw":
        out[:] = encoded.typed(entry.name, entry.dtype, entry.shape)
    elif kind == "lossless":
        pages = out.reshape(entry.shape[0], -1)
        lossless.decode_pages(
            _lossless_tensor(encoded, entry), pages, executor=executor, tensor=entry.name
        )
    else:
        from kvsnap.encoded.fp8_pages import decode_fp8_tensor

        decode_fp8_tensor(encoded, entry, out)


def _copy_pages(
    source: np.ndarray, pages: np.ndarray, after: Callable[[int, np.ndarray], None], first: int
) -> None:
    pages[:] = source
    after(first, pages.reshape(-1))


def _exact_tasks(
    encoded: EncodedFile, original: OriginalFile, kinds: dict[str, str]
) -> list[Callable[[], None]]:
    """The layer tensors of a file of ``lossless`` and ``raw`` ones, as tasks of about a chunk
    each (:func:`lossless.run_tasks`): each decodes or copies its pages into ``original``, then
    checks them against the original's page checksums while they are in cache, so the decoded
    pages are read once (the trailer is checked after, by those checksums)."""
    checksums = stored_block_checksums(original)
    tasks: list[Callable[[], None]] = []
    for row, entry in enumerate(original.layer_entries):
        pages = original.pages(entry)
        check = functools.partial(check_layer_pages, original, entry, stored=checksums[row])
        if kinds[entry.name] == "lossless":
            coded = _lossless_tensor(encoded, entry)
            tasks += lossless.chunk_decoders(coded, pages, tensor=entry.name, after=check)
            continue
        source = encoded.typed(entry.name, entry.dtype, entry.shape).reshape(pages.shape)
        step = lossless.chunk_pages(max(pages.shape[1], 1))
        tasks += [
            functools.partial(
                _copy_pages, source[first : first + step], pages[first : first + step], check, first
            )
            for first in range(0, len(pages), step)
        ]
    return tasks


def decode(encoded: EncodedFile, executor: Executor | None = None) -> np.ndarray:
    """The ordinary snapshot file ``encoded`` stands for, as bytes (see the module). Lossless
    chunks are decoded on ``executor``'s threads when one is given."""
    try:
        return _decoded_file(encoded, executor)
    except SnapshotCorruptError as error:
        if error.file is not None:
            raise
        # The codecs name the tensor and the chunk or block they refuse, not the file: it is
        # known here, and an error names it first (kvsnap.errors).
        raise SnapshotCorruptError(
            error.detail, file=encoded.file, tensor=error.tensor, block=error.block
        ) from None


def _decoded_file(encoded: EncodedFile, executor: Executor | None) -> np.ndarray:
    header = encoded.tensor(enc.ORIGINAL_HEADER_TENSOR).tobytes()
    kinds = _checked_structure(encoded, header)
    out = np.zeros(encoded.decoded_bytes, dtype=np.uint8)
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    original = parse_original(out, encoded.file)
    for entry in original.layout.entries:
        if not enc.is_padding(entry.name) and not is_layer_tensor(entry.name):
            original.bytes_of(entry)[:] = encoded.typed(entry.name, entry.dtype, entry.shape)
    if "fp8" in kinds.values():
        for entry in original.layer_entries:
            _decode_layer(encoded, entry, kinds[entry.name], original.bytes_of(entry), executor)
        for name in encoded.layout.fp8_names():
            if encoded.layout.page_checks:
                check_pages(encoded, name, enc.PAGES_SUFFIX)  # what a device restore checks
        _rechecksum(original)  # the checksums of the pages just decoded: nothing to compare
    else:
        # lossless: the original's own checksums prove it exact
        lossless.run_tasks(_exact_tasks(encoded, original, kinds), executor)
        check_trailer(original, stored_block_checksums(original))
    return out


def _checked_structure(encoded: EncodedFile, header: bytes) -> dict[str, str]:
    """How each layer tensor is stored, once everything the decoded file's size follows from
    is refused unless the stored tensors back it: the original ``header`` must describe a
    whole file (no shard or part) of exactly ``decoded_bytes``, and every tensor it names must
    be stored as its kind requires (:func:`_check_stored`). Only then is the decoded file's
    array made: a ``decoded_bytes`` of 2**60, or a header of 2**40 blocks, is a number with
    nothing stored behind it, refused, not allocated."""
    described = described_file(header, encoded.decoded_bytes, encoded.file)
    kinds = {str(k): str(v) for k, v in encoded.encoding["tensors"].items()}
    layer_entries = [entry for entry in described.entries if is_layer_tensor(entry.name)]
    if set(kinds) != {entry.name for entry in layer_entries}:
        raise SnapshotCorruptError(
            "the stored kinds do not name the layer tensors", file=encoded.file
        )
    expected = _expected_names(described.entries, kinds, encoded.layout.page_checks)
    present = [t.name for t in encoded.layout.checksummed]
    if present != expected:
        raise SnapshotCorruptError(
            f"holds tensors {present[:4]}..., expected {expected[:4]}...", file=encoded.file
        )
    for entry in described.entries:
        if not enc.is_padding(entry.name):
            _check_stored(encoded, entry, kinds.get(entry.name, "raw"))
    return kinds


def _check_stored(encoded: EncodedFile, entry: TensorEntry, kind: str) -> None:
    """Refuse a tensor of the decoded file that is not stored as ``kind`` stores it: as it
    is (a tensor that is no layer tensor, or ``raw``), as e4m3 values of its shape beside
    their scales and page checks (``fp8``), or as chunks whose table describes exactly its
    pages (``lossless``). Each decoded byte so has stored bytes behind it."""
    if kind == "lossless":
        coded = _lossless_tensor(encoded, entry)
        lossless.check_chunk_table(
            coded.chunk_table,
            word_bytes=coded.word_bytes,
            page_bytes=coded.page_bytes,
            num_pages=coded.num_pages,
            stored_bytes=coded.stored_bytes,
            tensor=entry.name,
        )
    elif kind == "fp8":
        for name, dtype, shape in companions(entry.name, entry.shape, encoded.layout.page_checks):
            encoded.typed(name, dtype, shape)
    else:
        encoded.typed(entry.name, entry.dtype, entry.shape)


def _rechecksum(original: OriginalFile) -> None:
    """Page checksums, page digests and trailer of ``original`` computed for its pages; a
    signature left zero."""
    by_name = original.layout.by_name
    rows = []
    digests = []
    for entry in original.layer_entries:
        page_bytes = entry.nbytes // max(entry.shape[0], 1)
        rows.append(block_digests(original.bytes_of(entry), page_bytes))
        if fmt.PAGE_DIGESTS_TENSOR in by_name:
            digests.append(fmt.page_digests(original.bytes_of(entry), page_bytes))
    checksums = np.stack(rows).astype("<u8")
    original.bytes_of(by_name[fmt.BLOCK_CHECKSUMS_TENSOR])[:] = checksums.view(np.uint8).reshape(-1)
    if digests:
        original.bytes_of(by_name[fmt.PAGE_DIGESTS_TENSOR])[:] = np.stack(digests).reshape(-1)
    if SIGNATURE_TENSOR in by_name:
        original.bytes_of(by_name[SIGNATURE_TENSOR])[:] = 0
    trailer = encode_trailer(trailer_digests(original, checksums))
    original.bytes_of(by_name[fmt.CHECKSUMS_TENSOR])[:] = np.frombuffer(trailer, dtype=np.uint8)


__all__ = ["NUMPY_TYPES", "EncodedFile", "decode", "is_encoded", "parse_encoded", "read_encoded"]
