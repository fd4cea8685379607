"""Encoded snapshots through transformers' own caches (the built-in model, bfloat16 and float32):
a ``DynamicCache`` captured ``lossless`` or ``fp8`` restores into a fresh continuous-batching
engine's ``PagedAttentionCache`` and into a new ``DynamicCache``, each holding exactly what the
file decodes to (lossless: the KV captured, bit for bit); the paged cache captured out again as
it is holds that KV, and captured encoded is byte for byte the encoding of that plain capture.
tests/encoded/test_restored_continuation.py continues generation from such restores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvsnap.encoded.write import recode_file
from kvsnap.snapshot import Snapshot

pytest.importorskip("transformers")

from transformers import GenerationConfig  # after the skip: it needs transformers
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import load_model

BLOCK = 16
PROMPT = "kvsnap restores the KV cache exactly, bit for bit."  # 51 tokens: 3 full blocks + 3


def _manager(model: Any) -> Any:
    """A small continuous-batching manager on the CPU, not started (16-token pages)."""
    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    size_name = "page_size" if "page_size" in fields else "block_size"
    return model.model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=16, max_batch_tokens=64, use_async_batching=False, **{size_name: BLOCK}
        ),
    )


def _kv(path: Path, sequence_id: str) -> dict[str, torch.Tensor]:
    """Each layer tensor of one sequence as ``path`` decodes it, ``(tokens, heads, dim)``."""
    with Snapshot.open(path) as snapshot:
        return {
            name: snapshot.sequence_kv(sequence_id, name)
            for name in snapshot.geometry.tensor_names()
        }


def _same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and tensor.shape == second[name].shape, name
        assert torch.equal(tensor.view(torch.uint8), second[name].view(torch.uint8)), name


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_an_encoded_snapshot_moves_between_dynamic_and_paged_caches(tmp_path, dtype, compression):
    model = load_model(dtype=dtype)
    [(cache, ids)] = kt.prefill(model, [PROMPT])
    plain, encoded = tmp_path / "plain.safetensors", tmp_path / "encoded.safetensors"
    kt.capture_dynamic_cache(cache, [ids], plain, model=model, block_size=BLOCK)
    kt.capture_dynamic_cache(
        cache, [ids], encoded, model=model, block_size=BLOCK, compression=compression
    )
    with Snapshot.open(encoded) as snapshot:
        assert snapshot.encoded.encoding["name"] == compression
        (record,) = snapshot.sequences
    decoded = _kv(encoded, record.id)
    if compression == "lossless":
        _same(decoded, _kv(plain, record.id))
    else:  # fp8: not the captured KV, but within a sixteenth of each block's largest value
        for name, tensor in _kv(plain, record.id).items():
            assert not torch.equal(decoded[name], tensor), name
            assert (decoded[name].float() - tensor.float()).abs().max() <= tensor.abs().max() / 16

    # Into a real PagedAttentionCache, then captured back out of it, plain and encoded again.
    attention = model.model.config._attn_implementation
    manager = _manager(model)
    try:
        kt.restore_paged_cache(encoded, manager, request_id="held", as_prefix=False, model=model)
        out_plain, out_encoded = tmp_path / "out.safetensors", tmp_path / "out-enc.safetensors"
        for path, stored in ((out_plain, "none"), (out_encoded, compression)):
            kt.capture_paged_cache(
                manager,
                ["held"],
                {"held": ids},
                path,
                model=model,
                compression=stored,
                reproducible=True,
            )
    finally:
        manager.destroy()
        if model.model.config._attn_implementation != attention:
            model.model.set_attn_implementation(attention)
    _same(_kv(out_plain, "held"), decoded)
    recoded = tmp_path / "recoded.safetensors"
    recode_file(out_plain, recoded, compression)
    assert out_encoded.read_bytes() == recoded.read_bytes()

    # Into a new DynamicCache: (1, heads, tokens, dim) per layer.
    restored, token_ids = kt.restore_dynamic_cache(encoded, model=model)
    assert token_ids == ids
    states = {}
    for layer, (keys, values) in enumerate(kt.dynamic_cache_states(restored)):
        states[f"layers.{layer}.key"] = keys[0].transpose(0, 1).contiguous()
        states[f"layers.{layer}.value"] = values[0].transpose(0, 1).contiguous()
    _same(states, decoded)
