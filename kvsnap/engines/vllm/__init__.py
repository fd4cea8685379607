"""kvsnap inside vLLM: the cache layouts vLLM registers, a prefix store, and a KV connector.

Turn it on with a ``kv_transfer_config`` (see docs/vllm.md)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVSnapConnector",
        "kv_connector_module_path": "kvsnap.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/var/cache/kvsnap", "mode": "persist"}}'

Modes (``kv_connector_extra_config["mode"]``):

* ``persist``: once a request's prompt is computed, the full blocks of the prompt are captured
  into a :class:`PrefixStore` (kvsnap snapshot files indexed by prefix hash). A later engine,
  after a restart too, reports those prefixes as matched tokens and loads them instead of
  recomputing them. Loads check the model fingerprint, the KV geometry, the token ids and every
  block checksum; anything that does not match is a logged miss (or, found while loading, a
  block load error vLLM recomputes), never wrong KV.
* ``dump``: the KV of selected requests, at the end of prefill or after a chosen number of
  decode steps, is written as an ordinary snapshot (``kvsnap inspect`` / ``kvsnap verify``).
* ``persist+dump``: both (dumps then go to ``PATH/dumps``).

The layout of the engine's cache comes from what vLLM says: the per-layer ``[B, H, N, C]``
tensors it registers, the physical layout it resolved (``LBHNC``, ``LBNHC``, ...) and the
attention backend that decides how K and V share the last axis. Anything else is refused when
the caches are registered.

Tensor parallelism: each rank copies the saved blocks of its own heads to host memory and the
TP group's CPU (gloo) group gathers them on rank 0, which builds one layout per rank over the
gathered copies and lets :func:`kvsnap.snapshot.capture` take from each rank the canonical
fragments it is elected for. The file is one complete, TP-free snapshot. Loads need no
collective: every rank reads its own heads out of the same canonical pages.

The package has one module per job (like vLLM's own offloading connector) and re-exports
their public names:

* :mod:`~kvsnap.engines.vllm.layout`: vLLM's registered caches as a ``CacheLayout``
  (:func:`vllm_layout`, :class:`BlockOrder`, :func:`probe_block_order`);
* :mod:`~kvsnap.engines.vllm.store`: the prefix store (:class:`PrefixStore`,
  :class:`StoreMatch`, :func:`store_namespace`);
* :mod:`~kvsnap.engines.vllm.options`: :class:`ConnectorOptions` (``kv_connector_extra_config``);
* :mod:`~kvsnap.engines.vllm.events`: :class:`EventLog`, :func:`read_events`,
  :func:`count_events`;
* :mod:`~kvsnap.engines.vllm.specs`: scheduler-to-worker metadata (:class:`LoadSpec`,
  :class:`SaveSpec`, :class:`KVSnapConnectorMetadata`);
* :mod:`~kvsnap.engines.vllm.scheduler` and :mod:`~kvsnap.engines.vllm.worker`: the two sides
  of the connector; :mod:`~kvsnap.engines.vllm.registration`: the worker's registered caches;
  :mod:`~kvsnap.engines.vllm.engine_config`: what is read from vLLM's config;
* :mod:`~kvsnap.engines.vllm.connector`: :class:`KVSnapConnector`, a facade that delegates to
  the scheduler or the worker side by role.

Only the connector class and the helpers that take vLLM objects need vLLM; this package, the
layout constructor :func:`vllm_layout` and :class:`PrefixStore` import and work without it.
"""

from kvsnap.engines.vllm.compat import VLLM_IMPORT_ERROR
from kvsnap.engines.vllm.connector import KVSnapConnector
from kvsnap.engines.vllm.events import EventLog, count_events, read_events
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
from kvsnap.engines.vllm.specs import (
    KVSnapConnectorMetadata,
    LoadSpec,
    SaveSpec,
    external_request_id,
)
from kvsnap.engines.vllm.store import PrefixStore, StoreMatch, safe_name, store_namespace

__all__ = [
    "BACKEND_KV_PACKING",
    "KV_CELLS",
    "KV_PLANES",
    "LAYER_AXIS_ORDER",
    "MODES",
    "VLLM_IMPORT_ERROR",
    "BlockOrder",
    "BlockWriter",
    "ConnectorOptions",
    "EventLog",
    "KVSnapConnector",
    "KVSnapConnectorMetadata",
    "LoadSpec",
    "PrefixStore",
    "SaveSpec",
    "StoreMatch",
    "count_events",
    "external_request_id",
    "probe_block_order",
    "read_events",
    "safe_name",
    "store_namespace",
    "vllm_layout",
]
