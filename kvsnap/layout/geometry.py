"""The model-level shape of one KV block (:class:`KVGeometry`), which fixes the canonical page.

The canonical page is, per layer and part (``key``/``value``, or ``latent`` for MLA), one block
of all KV heads and all tokens, token-major: ``(block_size, num_kv_heads, head_dim)``
(``(block_size, latent_dim)`` for MLA), contiguous. Snapshots store canonical pages, so any
layout can restore into any other.

The dtype names here are :mod:`kvsnap.dtypes`' table under the names this module has always
exported (``DTYPES``, ``SAFETENSORS_DTYPES``, ``dtype_name``, ``torch_dtype``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from kvsnap.dtypes import KV_DTYPES, kv_dtype_name, kv_element, kv_torch_dtype
from kvsnap.errors import LayoutError

KEY, VALUE, LATENT = "key", "value", "latent"
KV_PARTS = (KEY, VALUE)
MLA_PARTS = (LATENT,)


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (dtype names as stored in snapshots, mapped to torch dtypes) needs torch: built
    # on first use, so that describing a snapshot's geometry does not import it.
    if name == "DTYPES":
        return {dtype: element.torch for dtype, element in KV_DTYPES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The same dtypes under safetensors' names.
SAFETENSORS_DTYPES: dict[str, str] = {
    name: element.safetensors for name, element in KV_DTYPES.items()
}

#: The snapshot name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``).
dtype_name = kv_dtype_name
#: The torch dtype for a snapshot dtype name.
torch_dtype = kv_torch_dtype


@dataclass(frozen=True)
class KVGeometry:
    """The model-level shape of one KV block, which fixes the canonical page.

    Standard attention sets ``num_kv_heads`` and ``head_dim``; MLA sets ``latent_dim`` instead
    (and leaves the other two at 0). ``attention_types`` names each layer's attention
    (``"full"``, ``"sliding"`` or ``"mla"``); empty means ``"full"`` (or ``"mla"``) everywhere.
    """

    num_layers: int
    block_size: int
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    attention_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kv_element(self.dtype)
        if self.num_layers <= 0 or self.block_size <= 0:
            raise LayoutError(f"num_layers and block_size must be positive: {self}")
        if self.latent_dim:
            if self.num_kv_heads or self.head_dim:
                raise LayoutError("an MLA geometry has latent_dim and no num_kv_heads/head_dim")
        elif self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise LayoutError(f"num_kv_heads and head_dim must be positive: {self}")
        if self.attention_types and len(self.attention_types) != self.num_layers:
            raise LayoutError(
                f"attention_types names {len(self.attention_types)} layers, "
                f"the geometry has {self.num_layers}"
            )
        if not self.attention_types:
            default = "mla" if self.is_mla else "full"
            object.__setattr__(self, "attention_types", (default,) * self.num_layers)

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @property
    def parts(self) -> tuple[str, ...]:
        return MLA_PARTS if self.is_mla else KV_PARTS

    @property
    def element_size(self) -> int:
        return KV_DTYPES[self.dtype].size

    @property
    def canonical_page_shape(self) -> tuple[int, ...]:
        """Shape of one canonical page of one (layer, part), in elements."""
        if self.is_mla:
            return (self.block_size, self.latent_dim)
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def canonical_page_size_bytes(self) -> int:
        return math.prod(self.canonical_page_shape) * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers and parts."""
        return self.canonical_page_size_bytes * self.num_layers * len(self.parts)

    def tensor_names(self) -> list[str]:
        """Canonical tensor names in snapshot order: ``layers.{i}.{part}``."""
        return list(_tensor_names(self.num_layers, self.parts))

    def describe(self) -> str:
        if self.is_mla:
            heads = f"latent {self.latent_dim}"
        else:
            heads = f"{self.num_kv_heads} KV heads x head dim {self.head_dim}"
        return f"{self.num_layers} layers, {heads}, {self.block_size} tokens/block, {self.dtype}"


@functools.lru_cache(maxsize=64)
def _tensor_names(num_layers: int, parts: tuple[str, ...]) -> tuple[str, ...]:
    # Asked several times by every capture and restore: built once per shape.
    return tuple(canonical_name(layer, part) for layer in range(num_layers) for part in parts)


def canonical_name(layer: int, part: str) -> str:
    """The snapshot tensor name of one layer part: ``layers.3.key``."""
    return f"layers.{layer}.{part}"
