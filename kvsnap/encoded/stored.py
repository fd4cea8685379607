"""The tensors an encoded file stores, as they are made: each layer tensor of the decoded file
encoded (fp8 values and scales, lossless chunks and their table, or raw pages) and the fp8
pages' checks, in file order (:class:`StoredTensors`).

Both writers fill one: :mod:`kvsnap.encoded.write` from an ordinary file's bytes, and
:mod:`kvsnap.encoded.capture` from pages gathered out of the caches. The same functions encode
a tensor either way, so the two give the same bytes for the same pages.
"""

from __future__ import annotations

import math
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
    to_host: bool = True,
) -> None:
    """Quantize layer tensor ``entry``'s ``pages`` (its dtype, its shape, on the device that
    encodes) for the tokens ``counts`` says each block holds, and store the e4m3 values and
    scales; the pages and their decode are kept in ``out`` for the error report. With
    ``checks_on_device`` the stored pages' xxh3-64 (and with ``signed`` their BLAKE3) are
    computed where the values are, when that is a CUDA device. Without ``to_host`` the items
    hold the values (``uint8``) and scales (``float32``) as tensors where they were made, for
    the caller to bring over (:func:`host_items`)."""
    add_fp8_together(
        out,
        [entry],
        [pages],
        counts,
        checks_on_device=checks_on_device,
        signed=signed,
        to_host=to_host,
    )


def add_fp8_together(
    out: StoredTensors,
    entries: list[TensorEntry],
    pages: list[torch.Tensor],
    counts: torch.Tensor,
    *,
    checks_on_device: bool = False,
    signed: bool = False,
    to_host: bool = True,
) -> None:
    """:func:`add_fp8` of layer tensors of one shape and dtype (a layer's key and value, say)
    quantized as one: every (block, head) is quantized alone, so each tensor's values and
    scales are those it would have alone, for a few kernels less."""
    together = pages[0] if len(pages) == 1 else torch.cat(pages)
    quantized = fp8.quantize(together, token_counts=counts.repeat(len(pages)))
    decoded = fp8.dequantize(quantized.values, quantized.scales, together.dtype)
    flat = quantized.values.reshape(len(pages), -1)
    page_bytes = flat.shape[1] // max(entries[0].shape[0], 1)
    checks: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    if checks_on_device and flat.device.type == "cuda":
        pages_xxh3 = xxh3_pages(flat.reshape(-1), page_bytes).view(len(pages), -1)
        bound = blake3_pages(flat.reshape(-1), page_bytes) if signed else None
        bounds = bound.view(len(pages), -1, bound.shape[-1]) if bound is not None else None
        checks = [
            (pages_xxh3[i], bounds[i] if bounds is not None else None) for i in range(len(pages))
        ]
    scales = quantized.scales.view(len(pages), -1, quantized.scales.shape[-1])
    blocks = entries[0].shape[0]
    for index, entry in enumerate(entries):
        if checks:
            out.page_checks[entry.name] = checks[index]
        values = flat[index]
        out.items.append(
            (entry.name, "F8_E4M3", entry.shape, values.cpu().numpy() if to_host else values)
        )
        held = scales[index]
        out.items.append(
            (
                entry.name + enc.SCALES_SUFFIX,
                "F32",
                tuple(held.shape),
                _host_bytes(held) if to_host else held,
            )
        )
        out.kinds[entry.name] = "fp8"
        out.originals[entry.name] = pages[index]
        out.decoded[entry.name] = decoded[index * blocks : (index + 1) * blocks]


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.cpu().numpy().view(np.uint8).reshape(-1)


def host_items(items: list[Item]) -> list[Item]:
    """``items`` with every tensor held as a torch tensor brought to the host as bytes."""
    return [
        (name, dtype, shape, _host_bytes(data) if isinstance(data, torch.Tensor) else data)
        for name, dtype, shape, data in items
    ]


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
    stored: StoredTensors, layer: str, values: np.ndarray | None, page_bytes: int, signed: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """An fp8 tensor's page checks: those ``stored`` computed on the device, else (or a
    BLAKE3 missing there) hashed here from ``values`` (held on the host whenever a check was
    not made on the device)."""
    known, bound = stored.page_checks.get(layer, (None, None))
    if values is None and (known is None or (signed and bound is None)):
        raise ValueError(f"{layer}: neither its page checks nor its values are here")
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
    values_of = {name: (shape, array) for name, _, shape, array in stored.items}
    for name, dtype, shape, array in stored.items:
        items.append((name, dtype, shape, array))
        layer = name.removesuffix(enc.SCALES_SUFFIX)
        if name == layer or stored.kinds.get(layer) != "fp8":
            continue
        blocks = shape[0]
        values_shape, values = values_of[layer]
        page_bytes = math.prod(values_shape[1:])  # one byte an e4m3 value
        pages, digests = _checks_of(stored, layer, values, page_bytes, signed)
        pages = np.ascontiguousarray(pages, dtype="<u8")
        items.append((layer + enc.PAGES_SUFFIX, "U64", (blocks,), pages.view(np.uint8)))
        if digests is not None:
            items.append((layer + enc.DIGESTS_SUFFIX, "U8", digests.shape, digests.reshape(-1)))
    return items
