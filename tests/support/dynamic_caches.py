"""Comparing transformers caches in tests."""

from __future__ import annotations

from typing import Any

import torch

from kvsnap.engines import transformers as kt


def same_kv(a: Any, b: Any) -> bool:
    """Whether two caches hold bit-identical KV, layer by layer (as bytes: NaNs compare too)."""
    pairs = zip(kt.dynamic_cache_states(a), kt.dynamic_cache_states(b), strict=True)
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for first, second in pairs
        for x, y in zip(first, second, strict=True)
    )
