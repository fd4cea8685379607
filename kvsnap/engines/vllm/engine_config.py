"""What the connector reads from vLLM's objects: model fingerprint, KV dtype, geometry, rank.

Each function takes a ``VllmConfig`` (or a layer name) and needs vLLM only to be called.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from kvsnap import format as fmt
from kvsnap.engines.weights import checkpoint_weights_fingerprint
from kvsnap.errors import ModelLoadError
from kvsnap.layout import LayoutError, dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """The served model's fingerprint: its config (RoPE scaling included, and the settings of
    :func:`served_config`) and its weights (:func:`kvsnap.format.model_fingerprint_with_weights`),
    the weights sampled from the checkpoint's safetensors files (the scheduler holds no
    weights; a transformers model loaded from the same files gets the same fingerprint).

    Raises :class:`~kvsnap.errors.ModelLoadError` when the checkpoint's files cannot be found
    (a model id not in the local Hugging Face cache, or weights in another format): a store
    keyed on the config alone would serve a fine-tune the base model's KV.
    """
    model = vllm_config.model_config
    directory = weights_directory(str(model.model), model.revision)
    try:
        weights = checkpoint_weights_fingerprint(directory)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"KVSnapConnector cannot fingerprint the weights of {model.model!r}: {error}"
        ) from error
    return fmt.model_fingerprint_with_weights(served_config(model), weights)


#: The key :func:`served_config` records a load-time quantization under.
LOAD_QUANTIZATION_KEY = "kvsnap_load_quantization"


def served_config(model_config: Any) -> dict[str, Any]:
    """The config a served model's fingerprint covers: the checkpoint's (``hf_config``), and
    what vLLM takes from its own arguments that changes what the model computes while the
    checkpoint's config and weights stay the same: a quantization applied at load time
    (``--quantization fp8`` on bf16 weights) under :data:`LOAD_QUANTIZATION_KEY`. A
    checkpoint quantized ahead says so in its own ``quantization_config`` (and its weights
    are the quantized ones), so nothing is added for it, and an unquantized model's config is
    the checkpoint's unchanged: stores written before keep their namespace."""
    config: dict[str, Any] = model_config.hf_config.to_dict()
    quantization = getattr(model_config, "quantization", None)
    if quantization and "quantization_config" not in config:
        config[LOAD_QUANTIZATION_KEY] = str(quantization)
    return config


def weights_directory(model: str, revision: str | None) -> str:
    """The local directory holding ``model``'s checkpoint: ``model`` itself when it is a
    directory, else its snapshot in the local Hugging Face cache (never downloaded)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, revision=revision, local_files_only=True, allow_patterns=["*.safetensors"]
        )
    except Exception as error:  # the hub client raises many unrelated types for "not cached"
        raise ModelLoadError(
            f"KVSnapConnector cannot find the weights of {model!r} locally: {error}"
        ) from error


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
