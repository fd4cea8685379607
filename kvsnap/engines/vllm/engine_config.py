"""What the connector reads from vLLM's objects: model fingerprint, KV dtype, geometry, rank.

Each function takes a ``VllmConfig`` (or a layer name) and needs vLLM only to be called.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvsnap import format as fmt
from kvsnap.layout import LayoutError, dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """The served model's fingerprint (:func:`kvsnap.format.model_fingerprint` of its config)."""
    return fmt.model_fingerprint(vllm_config.model_config.hf_config.to_dict())


def kv_dtype(vllm_config: VllmConfig) -> str:
    """The KV cache's dtype name; a quantized cache (``cache_dtype`` not ``auto``) is refused."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise LayoutError(
            f"KVSnapConnector supports unquantized KV caches only (cache_dtype 'auto'), "
            f"got {cache_dtype!r}"
        )
    return dtype_name(vllm_config.model_config.dtype)


def source_info(vllm_config: VllmConfig, fingerprint: str) -> fmt.SourceInfo:
    """The ``source`` a snapshot written by this engine records."""
    import vllm

    model = vllm_config.model_config
    return fmt.SourceInfo(
        engine="vllm",
        engine_version=str(vllm.__version__),
        model_id=str(model.model),
        model_revision=model.revision,
        model_fingerprint=fingerprint,
    )


def expected_geometry(vllm_config: VllmConfig) -> dict[str, Any]:
    """The KV geometry fields the scheduler can know from the config alone."""
    model = vllm_config.model_config
    return {
        "num_layers": model.get_total_num_hidden_layers(),
        "num_kv_heads": model.get_total_num_kv_heads(),
        "head_dim": model.get_head_size(),
        "block_size": vllm_config.cache_config.block_size,
        "dtype": kv_dtype(vllm_config),
    }


def layer_index(name: str) -> int:
    """The layer number in a KV cache name such as ``model.layers.3.self_attn.attn``."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[0])


def tp_rank() -> int:
    """This process's rank in vLLM's tensor-parallel group (0 where there is none)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group
    except (ImportError, AssertionError):
        return 0
