"""Model fingerprints: a stable hash of a model config without its load-time keys."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

#: Config keys left out of :func:`model_fingerprint`, besides every key starting with ``_``:
#: they change with the loading code or the runtime settings, never with the weights' meaning.
#: The dtype is excluded because the snapshot's KV dtype is checked on its own (the layout).
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "attn_implementation",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
    }
)


def _canonical_config(value: Any, path: str) -> Any:
    """A JSON-ready copy of a config value with volatile keys removed, recursively."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "to_dict") and not isinstance(value, Mapping):
        value = value.to_dict()
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            name = str(key) if isinstance(key, int | str) else None
            if name is None:
                raise TypeError(
                    f"model config key {key!r} at {path or 'top level'} is not a string"
                )
            if name.startswith("_") or name in VOLATILE_CONFIG_KEYS:
                continue
            result[name] = _canonical_config(item, f"{path}.{name}" if path else name)
        return result
    if isinstance(value, list | tuple):
        return [_canonical_config(item, f"{path}[{index}]") for index, item in enumerate(value)]
    # torch dtypes and enums have stable names; anything else has no stable text form.
    module = type(value).__module__
    if module == "torch" and type(value).__name__ == "dtype":
        return str(value)
    if hasattr(value, "value") and hasattr(type(value), "__members__"):
        return _canonical_config(value.value, path)
    raise TypeError(
        f"model config value at {path or 'top level'} has unsupported type {type(value).__name__}"
    )


def model_fingerprint(config: Mapping[str, Any]) -> str:
    """A stable 32-digit hex fingerprint of a model config.

    ``config`` is a mapping (``config.to_dict()``; a transformers ``PretrainedConfig`` is also
    accepted). Keys starting with ``_`` and :data:`VOLATILE_CONFIG_KEYS` are dropped at every
    nesting level, the rest is serialized as JSON with sorted keys and hashed with xxh3-128.
    Two configs that differ only in volatile keys (load path, transformers version, dtype,
    attention implementation, runtime output flags) share a fingerprint; any other difference
    changes it.
    """
    canonical = _canonical_config(config, "")
    if not isinstance(canonical, dict):
        raise TypeError(f"model_fingerprint needs a mapping, got {type(config).__name__}")
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_hexdigest(text.encode())
