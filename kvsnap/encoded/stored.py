"""The tensors an encoded file stores, as they are made: each layer tensor of the decoded file
encoded (fp8 values and scales, lossless chunks and their table, or raw pages) and the fp8
pages' checks, in file order (:class:`StoredTensors`).

Both writers fill one: :mod:`kvsnap.encoded.write` from an ordinary file's bytes, and
:mod:`kvsnap.encoded.capture` from pages gathered out of the caches. The same functions encode
a tensor either way, so the two give the same bytes for the same pages.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsnap.encoded.page_digests import blake3_pages, to_host, xxh3_pages
from kvsnap.encoding import fp8, lossless
from kvsnap.format import encoded as enc
from kvsnap.format.container import TensorEntry
from kvsnap.format.hashing import block_digests
from kvsnap.format.hashing import page_digests as fmt_page_digests

#: Layer dtypes fp8 quantizes (others are stored raw), as torch dtypes.
FP8_SOURCES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
#: Codec names recorded per encoding.
CODECS = {"fp8": fp8.NAME, "lossless": lossless.NAME}

#: A stored tensor: name, safetensors dtype, shape, bytes.
Item = tuple[str, str, tuple[int, ...], Any]


@dataclass
class StoredTensors:
    """Tensors to store, in file order (``items``); per layer tensor how it is stored
    (``kinds``); the fp8 tensors' pages and their decode, kept for the error report
    (``originals``, ``decoded``: on the device that quantized them); and the fp8 pages'
    checks computed on that device (``page_checks``: xxh3-64, and signed BLAKE3, by tensor;
    a tensor missing there is hashed on the host); and the xxh3-128 of items hashed ahead,
    while later tensors were encoded (``digests``, by item name: the trailer's rows)."""

    items: list[Item] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    originals: dict[str, torch.Tensor] = field(default_factory=dict)
    decoded: dict[str, torch.Tensor] = field(default_factory=dict)
    page_checks: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    digests: dict[str, Future[bytes]] = field(default_factory=dict)


def encoding_device() -> torch.device:
    """Where fp8 pages are quantized and their error measured: the GPU when there is one (the
    same torch ops, bit for bit the same values, far faster), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def add_raw(out: StoredTensors, entry: TensorEntry, data: np.ndarray) -> None:
    """Store layer tensor ``entry`` as its decoded bytes ``data`` (kept: not copied)."""
    out.items.append((entry.name, entry.dtype, entry.shape, data))
    out.kinds[entry.name] = "raw"


def add_fp8(
    out: StoredTensors,
    entry: TensorEntry,
    pages: torch.Tensor,
    counts: torch.Tensor,
    *,
    checks_on_device: bool = False,
    signed: bool = False,
) -> None:
    """Quantize layer tensor ``entry``'s ``pages`` (its dtype, its shape, on the device that
    encodes) for the tokens ``counts`` says each block holds, and store the e4m3 values and
    scales; the pages and their decode are kept in ``out`` for the error report. With
    ``checks_on_device`` the stored pages' xxh3-64 (and with ``signed`` their BLAKE3) are
    computed where the values are, when that is a CUDA device."""
    quantized = fp8.quantize(pages, token_counts=counts)
    flat = quantized.values.reshape(-1)
    if checks_on_device and flat.device.type == "cuda":
        page_bytes = flat.numel() // max(entry.shape[0], 1)
        bound = blake3_pages(flat, page_bytes) if signed else None
        out.page_checks[entry.name] = (xxh3_pages(flat, page_bytes), bound)
    out.items.append((entry.name, "F8_E4M3", entry.shape, flat.cpu().numpy()))
    scales = quantized.scales.cpu().numpy()
    out.items.append(
        (entry.name + enc.SCALES_SUFFIX, "F32", scales.shape, scales.view(np.uint8).reshape(-1))
    )
    out.kinds[entry.name] = "fp8"
    out.originals[entry.name] = pages
    out.decoded[entry.name] = fp8.dequantize(quantized.values, quantized.scales, pages.dtype)


def add_lossless(
    out: StoredTensors, entry: TensorEntry, pages: np.ndarray, executor: Executor | None
) -> None:
    """Store layer tensor ``entry``, whose pages are ``pages`` (``uint8 (blocks, page
    bytes)``, kept when stored raw), as lossless chunks and their table, or raw when coding
    would not save enough."""
    coded = lossless.encode_pages(pages, enc.ITEM_BYTES[entry.dtype], executor=executor)
    if coded is None:
        add_raw(out, entry, pages.reshape(-1))
        return
    out.items.append((entry.name, "U8", (coded.stored_bytes,), coded.data))
    table = np.ascontiguousarray(coded.chunk_table, dtype="<u8")
    out.items.append(
        (entry.name + enc.CHUNKS_SUFFIX, "U64", table.shape, table.view(np.uint8).reshape(-1))
    )
    out.kinds[entry.name] = "lossless"


def _checks_of(
    stored: StoredTensors, layer: str, values: np.ndarray, blocks: int, signed: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """An fp8 tensor's page checks: those ``stored`` computed on the device, else (or a
    BLAKE3 missing there) hashed here from ``values``."""
    page_bytes = len(values) // max(blocks, 1)
    known, bound = stored.page_checks.get(layer, (None, None))
    pages = to_host([known], "xxh3")[0] if known is not None else block_digests(values, page_bytes)
    if not signed:
        return pages, None
    if bound is not None:
        return pages, to_host([bound], "blake3")[0]
    return pages, fmt_page_digests(values, page_bytes)


def with_page_checks(stored: StoredTensors, signed: bool) -> list[Item]:
    """``stored``'s items with each fp8 tensor's page checks after its scales: the xxh3-64 of
    every stored page, and (``signed``) its BLAKE3-256."""
    items = []
    values_of = {name: array for name, _, _, array in stored.items}
    for name, dtype, shape, array in stored.items:
        items.append((name, dtype, shape, array))
        layer = name.removesuffix(enc.SCALES_SUFFIX)
        if name == layer or stored.kinds.get(layer) != "fp8":
            continue
        blocks = shape[0]
        pages, digests = _checks_of(stored, layer, values_of[layer], blocks, signed)
        pages = np.ascontiguousarray(pages, dtype="<u8")
        items.append((layer + enc.PAGES_SUFFIX, "U64", (blocks,), pages.view(np.uint8)))
        if digests is not None:
            items.append((layer + enc.DIGESTS_SUFFIX, "U8", digests.shape, digests.reshape(-1)))
    return items
