"""kvsnap for Hugging Face transformers: ``DynamicCache``, continuous batching, and a dump hook.

Three ways transformers holds KV, and what this module does with each:

* **``DynamicCache``** (``model(...)``, ``model.generate(...)``): per layer a contiguous
  ``(batch, kv_heads, seq, head_dim)`` tensor. ``capture_dynamic_cache`` copies the rows
  once into a zero-padded, block-aligned buffer (a snapshot stores whole blocks) and captures it
  through ``kvsnap.layout.contiguous_layout``; ``restore_dynamic_cache`` restores into
  such a buffer and hands back a ``DynamicCache`` exactly ``num_tokens`` long.
* **``PagedAttentionCache``** (continuous batching, ``model.generate_batch`` and
  ``ContinuousBatchingManager``): blocks of ``page_size`` tokens, addressed through per-request
  block tables. ``capture_paged_cache`` captures live requests by their block tables,
  ``capture_paged_prefix`` captures the complete blocks the cache keeps for prefix sharing,
  and ``restore_paged_cache`` allocates blocks through the cache's own allocator, restores
  into them and (by default) registers them as cached prefix blocks, so that the next request
  whose prompt starts with those tokens skips their prefill — exactly how continuous batching
  resumes from its own prefix cache.
* **inside ``generate``**: ``KVDumpHook`` is a logits processor that snapshots the cache at
  one generation step and returns the scores untouched, so the output does not change.

transformers 5.17 to 5.24 are supported; the continuous-batching cache changed shape in that
range, and both are handled (``kvsnap.engines.transformers.paged_cache``). Every ``model``
parameter takes kvsnap's ``LoadedModel`` or a plain transformers model
(``kvsnap.engines.transformers.model``).

The modules: ``model`` (geometry, id and fingerprint of a model), ``generate`` (forward,
prefill, greedy continuation, ``generate`` from a restored cache), ``dynamic``
(``DynamicCache``), ``paged_cache`` and ``paged`` (continuous batching), ``dump`` (the hook).

Caches with sliding-window layer groups, and continuous batching with tensor-parallel KV heads,
are refused with a ``kvsnap.layout.LayoutError`` naming the reason: a sliding group keeps
only the last window of tokens, so a snapshot of it would not describe the sequence.
"""

from kvsnap.engines.transformers.dump import KVDumpHook, dump_at_step
from kvsnap.engines.transformers.dynamic import (
    capture_dynamic_cache,
    capture_dynamic_caches,
    dynamic_cache_states,
    restore_dynamic_cache,
)
from kvsnap.engines.transformers.generate import (
    continue_generation,
    forward_with_cache,
    generate_from_restored,
    generate_greedy,
    new_dynamic_cache,
    prefill,
    prefill_token_ids,
)
from kvsnap.engines.transformers.model import (
    ModelLike,
    attention_types,
    check_snapshot_fits,
    fingerprint_of,
    geometry_for_model,
    model_id_of,
    source_info,
)
from kvsnap.engines.transformers.paged import (
    PagedRestore,
    capture_manager_requests,
    capture_paged_cache,
    capture_paged_prefix,
    live_request_tokens,
    restore_paged_cache,
)
from kvsnap.engines.transformers.paged_cache import (
    PagedCacheAdapter,
    paged_cache_adapter,
    paged_cache_layout,
)

__all__ = [
    "KVDumpHook",
    "ModelLike",
    "PagedCacheAdapter",
    "PagedRestore",
    "attention_types",
    "capture_dynamic_cache",
    "capture_dynamic_caches",
    "capture_manager_requests",
    "capture_paged_cache",
    "capture_paged_prefix",
    "check_snapshot_fits",
    "continue_generation",
    "dump_at_step",
    "dynamic_cache_states",
    "fingerprint_of",
    "forward_with_cache",
    "generate_from_restored",
    "generate_greedy",
    "geometry_for_model",
    "live_request_tokens",
    "model_id_of",
    "new_dynamic_cache",
    "paged_cache_adapter",
    "paged_cache_layout",
    "prefill",
    "prefill_token_ids",
    "restore_dynamic_cache",
    "restore_paged_cache",
    "source_info",
]
