"""A transformers model's own attention queries, for the attention check of encoded KV.

The check kvsnap records in an fp8 snapshot (``kvsnap.encoding.measure``) draws its queries
from the keys, because a snapshot has no model. Where the model is at hand, its real queries
can be used instead: :func:`model_queries` runs one forward pass over token ids and records,
per layer, the query states each attention module attends with, that is ``q_proj`` of the
layer's normalized input, split into heads, with the model's rotary embedding (and any query
norm) applied by the model's own code: they are taken where the model hands them to its
attention function, under an attention implementation registered for the pass that records
them and then runs transformers' SDPA attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: The attention implementation name registered while queries are recorded.
RECORDING = "kvsnap_record_queries"


@contextlib.contextmanager
def _recording(module: Any, into: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module``'s attention through a recorder of each layer's query states."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def record(
        attention: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        into[int(attention.layer_idx)] = query.detach()  # (batch, heads, tokens, head_dim)
        return sdpa_attention_forward(attention, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(RECORDING, record)
    config = module.config
    before = config._attn_implementation
    config._attn_implementation = RECORDING
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.no_grad()
def model_queries(model: Any, token_ids: Sequence[int]) -> list[torch.Tensor]:
    """Per layer, the queries ``model`` (kvsnap's ``LoadedModel`` or a transformers causal LM)
    attends with at each of ``token_ids`` (one forward pass, no cache): ``(tokens,
    num_attention_heads, head_dim)`` in fp32."""
    from kvsnap.engines.transformers.model import module_of

    module = module_of(model)
    device = next(module.parameters()).device
    recorded: dict[int, torch.Tensor] = {}
    with _recording(module, recorded):
        module(input_ids=torch.tensor([list(token_ids)], device=device), use_cache=False)
    return [recorded[layer][0].transpose(0, 1).float() for layer in sorted(recorded)]


def per_kv_head(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Queries ``(tokens, num_attention_heads, head_dim)`` as the queries each KV head serves:
    ``(tokens * group, num_kv_heads, head_dim)``, query head ``h`` on KV head ``h // group``
    (transformers' ``repeat_kv``: each KV head repeated ``group`` times in a row)."""
    tokens, heads, head_dim = queries.shape
    group = heads // num_kv_heads
    if group * num_kv_heads != heads:
        raise ValueError(f"{heads} query heads do not share {num_kv_heads} KV heads evenly")
    grouped = queries.reshape(tokens, num_kv_heads, group, head_dim).transpose(1, 2)
    return grouped.reshape(tokens * group, num_kv_heads, head_dim)
