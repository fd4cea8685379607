"""Snapshot files of real KV for the encoded-snapshot tests: the built-in model's prefill
(tests/support/prefill_kv.py) written into a cache of any layout and captured; and a signed
encoded file with its signature tensor declared otherwise (:func:`with_signature_tensor`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch

import kvsnap
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.hashing import digest128, encode_trailer
from kvsnap.testing.caches import KVContent, SyntheticCache, make_cache, random_content
from tests.support.prefill_kv import BLOCK, built_in_kv

#: Tokens of the captured sequences (the second one ends inside a block).
TOKENS = (96, 70)
#: The cache blocks :func:`capture_mixed` captures, in order.
BLOCK_ORDER = np.array([3, 0, 7, 1, 6, 2, 5, 4])


#: fp8 cache dtypes: the built-in model's bfloat16 KV cast into them (an fp8 KV cache).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def real_content(dtype: torch.dtype, latent: bool = False) -> KVContent:
    """The built-in model's KV in ``dtype``, as canonical pages of 8 blocks; ``latent``: the
    keys of each layer reshaped into one MLA latent per token (heads x dims). An fp8 ``dtype``
    (:data:`FP8_CACHE_DTYPES`) holds the bfloat16 KV cast into it, as an fp8 cache of scale 1
    holds it."""
    if dtype in FP8_CACHE_DTYPES:
        cast = built_in_kv(128, torch.bfloat16).items()
        pages = {name: tensor[:8].float().clamp(-448, 448).to(dtype) for name, tensor in cast}
    else:
        pages = {name: tensor[:8] for name, tensor in built_in_kv(128, dtype).items()}
    if latent:
        pages = {
            name.replace("key", "latent"): tensor.reshape(*tensor.shape[:2], -1).contiguous()
            for name, tensor in pages.items()
            if name.endswith("key")
        }
    first = next(iter(pages.values()))
    if latent:
        geometry = kvsnap.KVGeometry(
            num_layers=len(pages),
            block_size=BLOCK,
            dtype=str(dtype).split(".")[1],
            latent_dim=first.shape[2],
            attention_types=("full",) * len(pages),
        )
    else:
        geometry = kvsnap.KVGeometry(
            num_layers=len(pages) // 2,
            block_size=BLOCK,
            dtype=str(dtype).split(".")[1],
            num_kv_heads=first.shape[2],
            head_dim=first.shape[3],
            attention_types=("full",) * (len(pages) // 2),
        )
    return KVContent(geometry, pages)


def real_caches(
    kind: str, dtype: torch.dtype, *, tp_size: int = 1, device: str = "cpu"
) -> list[SyntheticCache]:
    """Caches of layout ``kind`` (one per TP rank of ``tp_size``, on ``device``) of 8 blocks,
    holding the built-in model's KV (:func:`real_content`) in ``dtype``."""
    return filled_caches(real_content(dtype, latent=kind == "mla"), kind, tp_size, device)


def filled_caches(
    content: KVContent, kind: str, tp_size: int = 1, device: str = "cpu"
) -> list[SyntheticCache]:
    """Caches of layout ``kind`` (one per TP rank of ``tp_size``, on ``device``) holding
    ``content``'s pages in their first blocks."""
    geometry = content.geometry
    shape = (
        {"latent_dim": geometry.latent_dim}
        if geometry.is_mla
        else {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim}
    )
    caches = []
    for rank in range(tp_size):
        cache = make_cache(
            kind,
            num_layers=geometry.num_layers,
            num_blocks=content.num_blocks,
            block_size=geometry.block_size,
            dtype=next(iter(content.pages.values())).dtype,
            device=device,
            tp_rank=rank,
            tp_size=tp_size,
            **shape,
        )
        cache.fill(content)
        caches.append(cache)
    return caches


def real_sequences() -> list[kvsnap.SequenceBlocks]:
    """Sequence ``a`` of 96 tokens in blocks 6, 1, 4, 3, 0, 2 and sequence ``b`` of 70
    tokens sharing a's first block (stored once, so b's snapshot blocks are not one run)."""
    first = np.arange(TOKENS[0]) % 251
    second = np.concatenate([first[:BLOCK], 7 + np.arange(TOKENS[1] - BLOCK) % 241])
    return [
        kvsnap.SequenceBlocks("a", first, np.array([6, 1, 4, 3, 0, 2])),
        kvsnap.SequenceBlocks("b", second, np.array([6, 5, 7, 1, 0])),
    ]


def capture_real(path: Path, kind: str, dtype: torch.dtype, *, keys=None) -> KVContent:
    """Capture real KV from a cache of layout ``kind`` to ``path`` (:func:`real_sequences`)."""
    (cache,) = real_caches(kind, dtype)
    kvsnap.capture(cache.layout, real_sequences(), path, reproducible=True, keys=keys)
    return real_content(dtype, latent=kind == "mla")


def wide_content(dtype: torch.dtype, layers: int = 2) -> KVContent:
    """KV of the 8B shape's pages (8 KV heads of 128, blocks of 16: 32 KiB bf16 pages) for 8
    blocks of ``layers`` layers: normal samples from a fixed seed."""
    generator = torch.Generator().manual_seed(39)
    geometry = kvsnap.KVGeometry(
        num_layers=layers,
        block_size=BLOCK,
        dtype=str(dtype).split(".")[1],
        num_kv_heads=8,
        head_dim=128,
        attention_types=("full",) * layers,
    )
    pages = {}
    for name in geometry.tensor_names():
        pages[name] = torch.randn((8, BLOCK, 8, 128), generator=generator).to(dtype)
    return KVContent(geometry, pages)


#: Non-finite values :func:`planted_content` puts in the built-in model's KV: (tensor, block,
#: token, element of the token's page row, value); ``-nan`` has its sign bit set. Every one
#: lies in a token :func:`real_sequences` holds (blocks 1 and 0 are held twice: stored twice).
PLANTED = (
    ("layers.0.key", 6, 2, 3, "inf"),
    ("layers.0.key", 1, 5, 39, "-inf"),
    ("layers.1.value", 4, 0, 0, "nan"),
    ("layers.2.key", 3, 9, 62, "-nan"),
    ("layers.2.value", 7, 12, 37, "nan"),
    ("layers.2.value", 7, 12, 38, "-inf"),
    ("layers.3.value", 0, 3, 1, "inf"),
)


def planted_content(dtype: torch.dtype, latent: bool = False) -> KVContent:
    """:func:`real_content` with :data:`PLANTED`'s infinities and NaNs in some heads."""
    # Copies: real_content's pages are views of the prefill's KV, which other tests share.
    real = real_content(dtype, latent=latent)
    content = KVContent(real.geometry, {name: t.clone() for name, t in real.pages.items()})
    for name, block, token, element, value in PLANTED:
        name = name.replace("key", "latent") if latent else name
        if name in content.pages:
            rows = content.pages[name].view(*content.pages[name].shape[:2], -1)
            rows[block, token, element] = float(value)
    return content


def random_bits_content(dtype: torch.dtype, latent: bool = False) -> KVContent:
    """Pages of :func:`real_content`'s shape holding random bits (seeded): every finite
    magnitude of ``dtype``, infinities and NaNs."""
    geometry = real_content(dtype, latent=latent).geometry
    return random_content(geometry, 8, torch.Generator().manual_seed(39))


def content_named(name: str, dtype: torch.dtype, kind: str) -> KVContent:
    """``"built-in"``: :func:`real_content`; ``"wide"``: :func:`wide_content`; ``"planted"``:
    :func:`planted_content`; ``"random-bits"``: :func:`random_bits_content`."""
    if name == "wide":
        return wide_content(dtype)
    if name == "planted":
        return planted_content(dtype, latent=kind == "mla")
    if name == "random-bits":
        return random_bits_content(dtype, latent=kind == "mla")
    return real_content(dtype, latent=kind == "mla")


def capture_mixed(path: Path) -> KVContent:
    """Capture, in one sequence of 8 full blocks (no zeroed tail), the built-in model's bf16 KV
    with layer 1's keys given random mantissa bytes (a lossless tensor whose low plane is
    stored raw) and its values random bytes (a tensor stored raw by a lossless encode)."""
    content = real_content(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    for name, byte in (("layers.1.key", slice(0, None, 2)), ("layers.1.value", slice(None))):
        raw = content.pages[name].contiguous().view(torch.uint8).reshape(-1).clone()
        noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator)
        raw[byte] = noise[byte]
        shape = content.pages[name].shape
        content.pages[name] = raw.view(torch.bfloat16).reshape(shape)
    (cache,) = filled_caches(content, "vllm-nhd")
    tokens = np.arange(8 * BLOCK) % 251
    sequence = kvsnap.SequenceBlocks("a", tokens, BLOCK_ORDER)
    kvsnap.capture(cache.layout, [sequence], path, reproducible=True)
    return content


def with_signature_tensor(source: Path, target: Path, dtype: str, shape: tuple[int, ...]) -> None:
    """``source`` (a signed file, encoded or ordinary) with its signature tensor (its last)
    declared ``dtype`` ``shape``, its bytes the stored signature's cut or extended with zeros
    to that size; an encoded file's trailer is recomputed for the new header (an ordinary
    file's header is checked against its metadata before its trailer is read)."""
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8 : 8 + length])
    spec = entries[SIGNATURE_TENSOR]
    begin, end = spec["data_offsets"]
    nbytes = math.prod(shape) * enc.ITEM_BYTES[dtype]
    spec.update(dtype=dtype, shape=list(shape), data_offsets=[begin, begin + nbytes])
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=True).encode()
    assert len(text) <= length
    header = struct.pack("<Q", length) + text + b" " * (length - len(text))
    signature = (data[8 + length + begin : 8 + length + end] + bytes(nbytes))[:nbytes]
    out = np.frombuffer(header + data[8 + length : 8 + length + begin] + signature, np.uint8)
    out = out.copy()
    if enc.peek_version(header) == enc.ENCODED_FORMAT_VERSION:
        layout = enc.parse_header(header, len(out))
        rows = [digest128(header)]
        rows += [digest128(out[t.begin : t.end]) for t in layout.checksummed]
        trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
        out[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    out.tofile(target)
