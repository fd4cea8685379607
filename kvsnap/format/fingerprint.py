"""Model fingerprints: a stable hash of a model config without its load-time keys, and of its
weights (sampled or whole), combined into the one fingerprint a snapshot records."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

HEX64 = re.compile(r"[0-9a-f]{64}")

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


# -- weights ---------------------------------------------------------------------------------

#: Elements read per sampled window of a weight tensor, and windows per tensor (evenly spaced,
#: the first at its start and the last at its end). 16 x 32 elements of every tensor: a
#: fine-tune changes nearly every value of the tensors it trains, so a sample sees it, and an
#: 8B model's ~300 tensors cost ~300 KiB of reads once per model load.
SAMPLE_WINDOW_ELEMENTS = 32
SAMPLE_WINDOWS = 16
#: The dtype a :class:`WeightSample` of a floating-point tensor records: its values are
#: stored as bfloat16, so a checkpoint and a model loaded from it in another float dtype agree.
CANONICAL_FLOAT = "float-as-bf16"
#: safetensors dtype names whose samples are canonicalized to bfloat16.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class WeightSample:
    """What a weights fingerprint reads of one tensor: its name, its dtype (the safetensors
    name, or :data:`CANONICAL_FLOAT` for floating-point tensors), its shape, and the bytes of
    the elements at :func:`sample_windows` (every element for a full-content fingerprint),
    floating-point values as bfloat16."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sample: bytes


def sample_windows(num_elements: int, full: bool = False) -> list[tuple[int, int]]:
    """The ``(first_element, count)`` ranges a weights fingerprint reads of a tensor of
    ``num_elements``: :data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_WINDOW_ELEMENTS` spread
    evenly from its start to its end (the whole tensor when it is no larger, or with
    ``full``)."""
    if full or num_elements <= SAMPLE_WINDOWS * SAMPLE_WINDOW_ELEMENTS:
        return [(0, num_elements)] if num_elements else []
    last = num_elements - SAMPLE_WINDOW_ELEMENTS
    return [
        (last * index // (SAMPLE_WINDOWS - 1), SAMPLE_WINDOW_ELEMENTS)
        for index in range(SAMPLE_WINDOWS)
    ]


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) of float32 ``values``, rounded to nearest even as
    torch converts them; NaNs become the canonical quiet NaN."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).astype("<u2")


def weights_fingerprint(samples: Iterable[WeightSample], *, full: bool = False) -> str:
    """A 64-digit hex SHA-256 over every weight tensor's name, dtype, shape and sampled bytes,
    in name order; ``full`` records that the samples are whole tensors (a full-content
    fingerprint never equals a sampled one).

    The same tensors give the same fingerprint whether they are read from a checkpoint's
    safetensors files or from a loaded model (:mod:`kvsnap.engines.weights`), as long as the
    names and values agree (floating-point values compared as bfloat16).
    """
    hasher = hashlib.sha256(b"kvsnap-weights-v1\0full\0" if full else b"kvsnap-weights-v1\0")
    for item in sorted(samples, key=lambda sample: sample.name):
        header = json.dumps([item.name, item.dtype, list(item.shape)], separators=(",", ":"))
        hasher.update(len(header).to_bytes(8, "little") + header.encode())
        hasher.update(len(item.sample).to_bytes(8, "little") + item.sample)
    return hasher.hexdigest()


def model_fingerprint_with_weights(config: Mapping[str, Any], weights: str) -> str:
    """The fingerprint a snapshot records for a model whose weights are known: a 32-digit hex
    digest (SHA-256, truncated) of :func:`model_fingerprint` of ``config`` and ``weights``
    (:func:`weights_fingerprint`). Models that differ in config (RoPE scaling included) or in
    weights differ here; :func:`model_fingerprint` alone covers only the config."""
    if not HEX64.fullmatch(weights):
        raise ValueError(f"weights must be a 64-digit hex fingerprint, got {weights!r}")
    text = f"kvsnap-model-v2\0{model_fingerprint(config)}\0{weights}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]
