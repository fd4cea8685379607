"""Snapshot files of real KV for the encoded-snapshot tests: the built-in model's prefill
(tests/support/prefill_kv.py) written into a cache of any layout and captured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import kvsnap
from kvsnap.testing.caches import KVContent, make_cache
from tests.support.prefill_kv import BLOCK, built_in_kv

#: Tokens of the captured sequences (the second one ends inside a block).
TOKENS = (96, 70)
#: The cache blocks :func:`capture_mixed` captures, in order.
BLOCK_ORDER = np.array([3, 0, 7, 1, 6, 2, 5, 4])


def real_content(dtype: torch.dtype, latent: bool = False) -> KVContent:
    """The built-in model's KV in ``dtype``, as canonical pages of 8 blocks; ``latent``: the
    keys of each layer reshaped into one MLA latent per token (heads x dims)."""
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


def capture_real(path: Path, kind: str, dtype: torch.dtype, *, keys=None) -> KVContent:
    """Capture real KV from a cache of layout ``kind`` to ``path``: sequence ``a`` of 96
    tokens in blocks 6, 1, 4, 3, 0, 2, sequence ``b`` of 70 tokens sharing a's first block."""
    content = real_content(dtype, latent=kind == "mla")
    geometry = content.geometry
    shape = (
        {"latent_dim": geometry.latent_dim}
        if kind == "mla"
        else {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim}
    )
    cache = make_cache(
        kind, num_layers=geometry.num_layers, num_blocks=8, block_size=BLOCK, dtype=dtype, **shape
    )
    cache.fill(content)
    first = np.arange(TOKENS[0]) % 251
    # b shares a's first block (stored once), so b's snapshot blocks are not one run.
    second = np.concatenate([first[:BLOCK], 7 + np.arange(TOKENS[1] - BLOCK) % 241])
    sequences = [
        kvsnap.SequenceBlocks("a", first, np.array([6, 1, 4, 3, 0, 2])),
        kvsnap.SequenceBlocks("b", second, np.array([6, 5, 7, 1, 0])),
    ]
    kvsnap.capture(cache.layout, sequences, path, reproducible=True, keys=keys)
    return content


def capture_mixed(path: Path) -> KVContent:
    """Capture, in one sequence of 8 full blocks (no zeroed tail), the built-in model's bf16 KV
    with layer 1's keys given random mantissa bytes (a lossless tensor whose low plane is
    stored raw) and its values random bytes (a tensor stored raw by a lossless encode)."""
    content = real_content(torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    for name, byte in (("layers.1.key", slice(0, None, 2)), ("layers.1.value", slice(None))):
        page_bytes = content.pages[name].contiguous().view(torch.uint8).reshape(-1).clone()
        noise = torch.randint(0, 256, page_bytes.shape, dtype=torch.uint8, generator=generator)
        page_bytes[byte] = noise[byte]
        shape = content.pages[name].shape
        content.pages[name] = page_bytes.view(torch.bfloat16).reshape(shape)
    geometry = content.geometry
    cache = make_cache(
        "vllm-nhd",
        num_layers=geometry.num_layers,
        num_blocks=8,
        block_size=BLOCK,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=torch.bfloat16,
    )
    cache.fill(content)
    tokens = np.arange(8 * BLOCK) % 251
    sequence = kvsnap.SequenceBlocks("a", tokens, BLOCK_ORDER)
    kvsnap.capture(cache.layout, [sequence], path, reproducible=True)
    return content
