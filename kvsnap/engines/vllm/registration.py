"""The caches vLLM registers with a worker, read into a :class:`RegisteredCache`.

:func:`register_caches` checks the per-layer tensors against the attention layers of vLLM's
forward context (one backend, one head size, no shared tensors), learns the CPU kernel's block
order where the backend needs it, and builds the rank's :class:`~kvsnap.layout.CacheLayout`
with :func:`~kvsnap.engines.vllm.layout.vllm_layout`. Anything else raises
:class:`~kvsnap.layout.LayoutError` and the engine does not start. :func:`registered_cache`
builds the same from tensors and the facts vLLM reports, without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvsnap.engines.vllm.engine_config import layer_index
from kvsnap.engines.vllm.layout import (
    BACKEND_KV_PACKING,
    KV_PLANES,
    BlockOrder,
    probe_block_order,
    vllm_layout,
)
from kvsnap.layout import CacheLayout, LayoutError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvsnap.engines.vllm")


@dataclass(frozen=True)
class RegisteredCache:
    """One worker's KV cache: its layout, its per-layer tensors and how they were read."""

    layout: CacheLayout
    caches: list[torch.Tensor]
    backend: str
    kv_cache_layout: str
    block_order: BlockOrder | None


def _attention_layers(
    context: Mapping[str, Any], names: Sequence[str]
) -> tuple[str, int, list[str]]:
    """The one backend name and head size of the layers ``names``, and their attention types."""
    backends, head_sizes, attention_types = set(), set(), []
    for name in names:
        layer = context.get(name)
        if layer is None or not hasattr(layer, "attn_backend"):
            raise LayoutError(f"KV cache {name!r} does not belong to an attention layer")
        backends.add(layer.attn_backend.get_name())
        head_sizes.add(layer.head_size)
        attention_types.append("sliding" if getattr(layer, "sliding_window", None) else "full")
    if len(backends) != 1 or len(head_sizes) != 1:
        raise LayoutError(
            f"KVSnapConnector needs one attention backend and head size for all layers, got "
            f"backends {sorted(backends)}, head sizes {sorted(head_sizes)}"
        )
    return backends.pop(), head_sizes.pop(), attention_types


def register_caches(
    vllm_config: VllmConfig, kv_caches: Mapping[str, torch.Tensor]
) -> RegisteredCache:
    """Build the rank's cache layout from the registered tensors, or refuse them (LayoutError).

    Reads the backend, head size, attention types, physical layout and TP rank from vLLM
    (and probes the CPU kernel's block order), then builds the cache with
    :func:`registered_cache`.
    """
    context = vllm_config.compilation_config.static_forward_context
    names = sorted(kv_caches, key=layer_index)
    backend, head_size, attention_types = _attention_layers(context, names)
    tensors = [kv_caches[name] for name in names]
    _check_distinct(tensors)
    layout_name = vllm_config.cache_config.kv_cache_layout
    if layout_name is None:
        raise LayoutError("vLLM has not resolved its KV cache layout")
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    block_order = None
    if BACKEND_KV_PACKING.get(backend) == KV_PLANES:
        block_order = _probe_layer(context, names, tensors[0], head_size)
    return registered_cache(
        tensors,
        backend=backend,
        kv_cache_layout=str(layout_name),
        head_size=head_size,
        num_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
        tp_rank=group.rank_in_group,
        tp_size=group.world_size,
        attention_types=attention_types,
        block_order=block_order,
    )


#: vLLM cache types that free blocks a request still covers (behind a sliding window, outside
#: a local-attention chunk): a prefix saved from them would hold vLLM's placeholder block.
_DROPPING_SPECS = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec", "CircularBufferSpec")


def refuse_dropping_caches(kv_cache_config: Any) -> None:
    """Refuse (:class:`~kvsnap.layout.LayoutError`, one line) a KV cache any of whose groups
    frees blocks inside a request's prefix: sliding-window, chunked-local or circular-buffer
    attention layers, as vLLM keeps them when its hybrid allocator is off (it is for
    connectors without ``SupportsHMA``). Such a prefix cannot be persisted or loaded whole."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        kinds = {cls.__name__ for cls in type(group.kv_cache_spec).__mro__}
        found = sorted(kinds.intersection(_DROPPING_SPECS))
        if found:
            raise LayoutError(
                f"KVSnapConnector does not support {found[0]} KV caches (sliding-window or "
                "local attention): vLLM frees blocks behind the window, so a stored prefix "
                "would be incomplete; serve this model without the connector"
            )


def registered_cache(
    kv_caches: Sequence[torch.Tensor],
    *,
    backend: str,
    kv_cache_layout: str,
    head_size: int,
    num_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
    block_order: BlockOrder | None = None,
) -> RegisteredCache:
    """The :class:`RegisteredCache` of one rank's per-layer ``[B, H, N, C]`` cache views (in
    layer order), described as vLLM describes them: what :func:`register_caches` builds from
    vLLM's config, and what a caller without vLLM (a benchmark, a test) passes directly.

    The arguments are those of :func:`~kvsnap.engines.vllm.layout.vllm_layout`. Layers that
    share one tensor, and anything :func:`vllm_layout` refuses, raise
    :class:`~kvsnap.layout.LayoutError`.
    """
    tensors = list(kv_caches)
    _check_distinct(tensors)
    layout = vllm_layout(
        tensors,
        backend=backend,
        kv_cache_layout=kv_cache_layout,
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
        block_order=block_order,
    )
    if tensors[0].device.type == "cpu":
        request_amx_permission()
    return RegisteredCache(layout, tensors, backend, kv_cache_layout, block_order)


def _check_distinct(tensors: Sequence[torch.Tensor]) -> None:
    """Refuse layers that share one KV tensor (vLLM's KV sharing)."""
    if len({tensor.data_ptr() for tensor in tensors}) != len(tensors):
        raise LayoutError("layers share KV cache tensors (KV sharing); kvsnap does not support it")


def _probe_layer(
    context: Mapping[str, Any], names: Sequence[str], cache: torch.Tensor, head_size: int
) -> BlockOrder:
    """The block order of the CPU backend's kernel, learned by calling it on a scratch block.

    Every layer must use the same kernel variant (``isa``: ``amx``, ``vec``, ...), since one
    order is learned for all of them.
    """
    layers = [context[name] for name in names]
    variants = {getattr(layer, "isa", None) for layer in layers}
    if len(variants) != 1:
        raise LayoutError(
            f"the CPU attention layers use different kernels: {sorted(map(str, variants))}"
        )
    first = layers[0]
    _, heads, block_size, _ = cache.shape
    slots = torch.arange(block_size, dtype=torch.int64)

    def write(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        first.impl.do_kv_cache_update(first, key, value, block, slots)

    if cache.device.type == "cpu":
        request_amx_permission()
    return probe_block_order(
        write, heads=heads, block_size=block_size, head_size=head_size, dtype=cache.dtype
    )


def request_amx_permission() -> None:
    """Ask Linux for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) where the CPU has AMX.

    vLLM's CPU attention kernel runs on AMX tiles, and a process that uses them without this
    permission dies of SIGILL. vLLM 0.32 only obtains it on paths a normal prefill takes first;
    an engine whose first forward pass attends over KV loaded by a connector (a prompt prefix
    restored right after start-up) reaches the kernel without it.
    """
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        logger.warning("the CPU has AMX, but Linux refused the AMX tile permission")
