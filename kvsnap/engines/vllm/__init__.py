"""kvsnap inside vLLM: the cache layouts vLLM registers, a prefix store, and a KV connector.

Turn it on with a ``kv_transfer_config`` (see docs/vllm.md)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVSnapConnector",
        "kv_connector_module_path": "kvsnap.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/var/cache/kvsnap", "mode": "persist"}}'

Modes (``kv_connector_extra_config["mode"]``):

* ``persist``: once a request's prompt is computed, its full blocks are stored in a
  :class:`PrefixStore` as content-addressed chunks (kvsnap snapshots named by the prefix hash
  of their last block, shared by every prompt with that prefix; bounded by
  ``store_capacity_bytes`` with LRU eviction). A later engine, after a restart too, reports
  those prefixes as matched tokens and loads them instead of recomputing them. Chunks are
  checked (model fingerprint, KV geometry, token ids and, before they are offered, every
  checksum); a chunk that fails is a logged miss and is quarantined, never wrong KV and never
  a failed request.
* ``dump``: the KV of selected requests, at the end of prefill or after a chosen number of
  decode steps, is written as an ordinary snapshot (``kvsnap inspect`` / ``kvsnap verify``).
* ``persist+dump``: both (dumps then go to ``PATH/dumps``).

The layout of the engine's cache comes from what vLLM says: the per-layer ``[B, H, N, C]``
tensors it registers, the physical layout it resolved (``LBHNC``, ``LBNHC``, ...) and the
attention backend that decides how K and V share the last axis. Anything else is refused when
the caches are registered.

Saves never hold up the engine at TP = 1: ``wait_for_save`` records a CUDA event behind the
forward pass and a background thread captures the blocks straight from the cache through the
warm :class:`~kvsnap.pipeline.Pipeline`, its copies ordered after that event; vLLM keeps the
blocks of a finished request until ``get_finished`` reports its copies done. At TP > 1 each
rank copies the saved blocks of its own heads to host memory and the TP group's CPU (gloo)
group gathers them on rank 0, which builds one layout per rank over the gathered copies and
lets :func:`kvsnap.snapshot.capture` take from each rank the canonical fragments it is elected
for. The file is one complete, TP-free snapshot. Loads need no collective: every rank reads its
own heads out of the same canonical pages.

The package has one module per job (like vLLM's own offloading connector) and re-exports
their public names:

* :mod:`~kvsnap.engines.vllm.layout`: vLLM's registered caches as a ``CacheLayout``
  (:func:`vllm_layout`, :class:`BlockOrder`, :func:`probe_block_order`);
* :mod:`~kvsnap.engines.vllm.prefix_store`: the prefix store (:class:`PrefixStore`,
  :class:`StoreMatch`, :class:`ChunkRef`, :func:`store_namespace`);
  :mod:`~kvsnap.engines.vllm.store_listing`: a store's entries and sizes
  (:func:`store_entries`); :mod:`~kvsnap.engines.vllm.eviction`: LRU pruning
  (:func:`prune_store`); :mod:`~kvsnap.engines.vllm.chunk_check`: the
  scheduler's check of a chunk (:class:`ChunkChecker`);
* :mod:`~kvsnap.engines.vllm.options`: :class:`ConnectorOptions` (``kv_connector_extra_config``);
* :mod:`~kvsnap.engines.vllm.events`: :class:`EventLog`, :func:`read_events`,
  :func:`count_events`;
* :mod:`~kvsnap.engines.vllm.specs`: scheduler-to-worker metadata (:class:`LoadSpec`,
  :class:`SaveSpec`, :class:`KVSnapConnectorMetadata`);
* :mod:`~kvsnap.engines.vllm.scheduler` and :mod:`~kvsnap.engines.vllm.worker`: the two sides
  of the connector; :mod:`~kvsnap.engines.vllm.worker_saves`: the worker's save path
  (:class:`WorkerSaves`), over :mod:`~kvsnap.engines.vllm.saves`: its save queue;
  :mod:`~kvsnap.engines.vllm.registration`: the worker's registered caches
  (:class:`RegisteredCache`, :func:`registered_cache`);
  :mod:`~kvsnap.engines.vllm.engine_config`: what is read from vLLM's config;
* :mod:`~kvsnap.engines.vllm.connector`: :class:`KVSnapConnector`, a facade that delegates to
  the scheduler or the worker side by role.

Only the connector class and the helpers that take vLLM objects need vLLM; this package, the
layout constructor :func:`vllm_layout`, the store, its eviction and the chunk checks import and
work without it. The names are imported on first use (:data:`_MODULE_OF`): importing the
package, or one of its modules that needs no torch (the store key of
:mod:`~kvsnap.engines.vllm.identity`, which the CLI reads), loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each exported name and the module it is imported from, on first use.
_MODULE_OF = {
    "ChunkChecker": "kvsnap.engines.vllm.chunk_check",
    "VLLM_IMPORT_ERROR": "kvsnap.engines.vllm.compat",
    "KVSnapConnector": "kvsnap.engines.vllm.connector",
    "EventLog": "kvsnap.engines.vllm.events",
    "count_events": "kvsnap.engines.vllm.events",
    "read_events": "kvsnap.engines.vllm.events",
    "StoreEntry": "kvsnap.engines.vllm.store_listing",
    "prune_store": "kvsnap.engines.vllm.eviction",
    "store_bytes": "kvsnap.engines.vllm.store_listing",
    "store_entries": "kvsnap.engines.vllm.store_listing",
    "CacheIdentity": "kvsnap.engines.vllm.identity",
    "MultimodalInput": "kvsnap.engines.vllm.identity",
    "adapter_digest": "kvsnap.engines.vllm.identity",
    "identity_of": "kvsnap.engines.vllm.identity",
    "store_key_chain": "kvsnap.engines.vllm.identity",
    "BACKEND_KV_PACKING": "kvsnap.engines.vllm.layout",
    "KV_CELLS": "kvsnap.engines.vllm.layout",
    "KV_PLANES": "kvsnap.engines.vllm.layout",
    "LAYER_AXIS_ORDER": "kvsnap.engines.vllm.layout",
    "BlockOrder": "kvsnap.engines.vllm.layout",
    "BlockWriter": "kvsnap.engines.vllm.layout",
    "probe_block_order": "kvsnap.engines.vllm.layout",
    "vllm_layout": "kvsnap.engines.vllm.layout",
    "MODES": "kvsnap.engines.vllm.options",
    "ConnectorOptions": "kvsnap.engines.vllm.options",
    "ChunkRef": "kvsnap.engines.vllm.prefix_store",
    "PrefixStore": "kvsnap.engines.vllm.prefix_store",
    "StoreMatch": "kvsnap.engines.vllm.prefix_store",
    "check_store_directory": "kvsnap.engines.vllm.prefix_store",
    "chunk_sequence_id": "kvsnap.engines.vllm.prefix_store",
    "safe_name": "kvsnap.engines.vllm.prefix_store",
    "store_namespace": "kvsnap.engines.vllm.prefix_store",
    "RegisteredCache": "kvsnap.engines.vllm.registration",
    "registered_cache": "kvsnap.engines.vllm.registration",
    "ChunkLoad": "kvsnap.engines.vllm.specs",
    "KVSnapConnectorMetadata": "kvsnap.engines.vllm.specs",
    "KVSnapWorkerMetadata": "kvsnap.engines.vllm.specs",
    "LoadSpec": "kvsnap.engines.vllm.specs",
    "SaveSpec": "kvsnap.engines.vllm.specs",
    "external_request_id": "kvsnap.engines.vllm.specs",
}

if TYPE_CHECKING:
    from kvsnap.engines.vllm.chunk_check import ChunkChecker
    from kvsnap.engines.vllm.compat import VLLM_IMPORT_ERROR
    from kvsnap.engines.vllm.connector import KVSnapConnector
    from kvsnap.engines.vllm.events import (
        EventLog,
        count_events,
        read_events,
    )
    from kvsnap.engines.vllm.eviction import prune_store
    from kvsnap.engines.vllm.identity import (
        CacheIdentity,
        MultimodalInput,
        adapter_digest,
        identity_of,
        store_key_chain,
    )
    from kvsnap.engines.vllm.layout import (
        BACKEND_KV_PACKING,
        KV_CELLS,
        KV_PLANES,
        LAYER_AXIS_ORDER,
        BlockOrder,
        BlockWriter,
        probe_block_order,
        vllm_layout,
    )
    from kvsnap.engines.vllm.options import MODES, ConnectorOptions
    from kvsnap.engines.vllm.prefix_store import (
        ChunkRef,
        PrefixStore,
        StoreMatch,
        check_store_directory,
        chunk_sequence_id,
        safe_name,
        store_namespace,
    )
    from kvsnap.engines.vllm.registration import RegisteredCache, registered_cache
    from kvsnap.engines.vllm.specs import (
        ChunkLoad,
        KVSnapConnectorMetadata,
        KVSnapWorkerMetadata,
        LoadSpec,
        SaveSpec,
        external_request_id,
    )
    from kvsnap.engines.vllm.store_listing import StoreEntry, store_bytes, store_entries


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BACKEND_KV_PACKING",
    "KV_CELLS",
    "KV_PLANES",
    "LAYER_AXIS_ORDER",
    "MODES",
    "VLLM_IMPORT_ERROR",
    "BlockOrder",
    "BlockWriter",
    "CacheIdentity",
    "ChunkChecker",
    "ChunkLoad",
    "ChunkRef",
    "ConnectorOptions",
    "EventLog",
    "KVSnapConnector",
    "KVSnapConnectorMetadata",
    "KVSnapWorkerMetadata",
    "LoadSpec",
    "MultimodalInput",
    "PrefixStore",
    "RegisteredCache",
    "SaveSpec",
    "StoreEntry",
    "StoreMatch",
    "adapter_digest",
    "check_store_directory",
    "chunk_sequence_id",
    "count_events",
    "external_request_id",
    "identity_of",
    "probe_block_order",
    "prune_store",
    "read_events",
    "registered_cache",
    "safe_name",
    "store_bytes",
    "store_entries",
    "store_key_chain",
    "store_namespace",
    "vllm_layout",
]
