"""Real KV for the encoding tests: the built-in model's prefill of a fixed English text, as
canonical pages per layer tensor (``layers.{i}.key`` / ``.value``, ``(blocks, tokens, heads,
head_dim)``), made once per process and dtype."""

from __future__ import annotations

import functools

import torch

#: Tokens per block of the pages made here.
BLOCK = 16

TEXT = (
    "A snapshot is a safetensors file that any safetensors reader opens, with versioned, "
    "checksummed metadata that kvsnap uses to inspect, verify, compare and restore it into any "
    "supported cache layout. A hit is served only when it is the right KV: a snapshot records "
    "its model by config and weights, and the store keys every chunk on the request's whole "
    "identity. Restore runs the same path backwards: file, staging slot, device buffer, the "
    "checksum of every page on the device, and the page-copy kernel scattering the pages that "
    "match into the cache's blocks. "
)


@functools.lru_cache(maxsize=4)
def built_in_kv(tokens: int = 256, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The built-in model's KV of the first ``tokens`` (a multiple of :data:`BLOCK`) byte
    tokens of :data:`TEXT` repeated, in ``dtype``."""
    from kvsnap.engines import transformers as kt
    from kvsnap.engines.default_model import load_model
    from kvsnap.engines.transformers.dynamic import dynamic_cache_states

    model = load_model(dtype=dtype)
    ids = (model.encode(TEXT * (1 + tokens // len(TEXT))))[:tokens]
    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    pages = {}
    for layer, (keys, values) in enumerate(dynamic_cache_states(cache)):
        for part, states in (("key", keys), ("value", values)):
            # (1, heads, tokens, dim) -> (blocks, BLOCK, heads, dim)
            token_major = states[0].transpose(0, 1).contiguous()
            pages[f"layers.{layer}.{part}"] = token_major.reshape(
                tokens // BLOCK, BLOCK, *token_major.shape[1:]
            )
    return pages
