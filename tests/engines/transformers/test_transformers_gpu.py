"""kvsnap with transformers on CUDA in bf16: snapshot, restore, and continue generating exactly.

Skipped without CUDA. The reference for every comparison is the same computation without the
snapshot (same shapes, same kernels), so equality is exact: bf16 rounding differs between a
prefill and a decode step, but a restored cache is bit-identical to the captured one, so the
tokens must be too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

BLOCK = 16
PROMPT = "kvsnap restores the KV cache exactly, bit for bit, on the GPU too."
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def loaded() -> Any:
    from kvsnap.engines.default_model import load_model

    return load_model(dtype=torch.bfloat16, device="cuda")


@contextmanager
def manager_for(loaded: Any, new_tokens: int) -> Iterator[Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    size_name = "page_size" if "page_size" in fields else "block_size"
    attention = loaded.model.config._attn_implementation
    manager = loaded.model.init_continuous_batching(
        generation_config=GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=256, max_batch_tokens=512, use_async_batching=False, **{size_name: BLOCK}
        ),
    )
    try:
        yield manager
    finally:
        if manager.is_running():
            manager.stop(block=True)
        manager.destroy()
        if loaded.model.config._attn_implementation != attention:
            loaded.model.set_attn_implementation(attention)


def run_request(manager: Any, ids: list[int], new_tokens: int) -> list[int]:
    request_id = manager.add_request(ids, max_new_tokens=new_tokens)
    for output in manager.request_id_iter(request_id):
        if output.is_finished():
            assert output.error is None, output.error
            return list(output.generated_tokens)
    raise AssertionError("the continuous batching loop ended before the request finished")


def test_dynamic_cache_bf16_round_trip_continues_exactly(loaded: Any, tmp_path: Path) -> None:
    from kvsnap.engines import transformers as kt

    [(cache, ids)] = kt.prefill(loaded, [PROMPT])
    [(uninterrupted_cache, _)] = kt.prefill(loaded, [PROMPT])
    reference = kt.continue_generation(loaded, uninterrupted_cache, ids, NEW_TOKENS)
    assert len(set(reference)) > 4  # a non-degenerate run, so equality means something

    path = tmp_path / "prompt.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=loaded, block_size=BLOCK)
    restored, token_ids = kt.restore_dynamic_cache(path, model=loaded, device="cuda")
    assert token_ids == ids
    for original, copy in zip(cache.layers, restored.layers, strict=True):
        assert copy.keys.device.type == "cuda" and copy.keys.dtype == torch.bfloat16
        assert torch.equal(original.keys, copy.keys)
        assert torch.equal(original.values, copy.values)
    assert kt.continue_generation(loaded, restored, token_ids, NEW_TOKENS) == reference


def test_dump_hook_on_cuda_leaves_generate_unchanged(loaded: Any, tmp_path: Path) -> None:
    from kvsnap.engines import transformers as kt

    ids = torch.tensor([loaded.encode(PROMPT)], device="cuda")
    with torch.no_grad():
        plain = loaded.model.generate(ids, max_new_tokens=12, do_sample=False)
    hook = kt.KVDumpHook(tmp_path / "step4.safetensors", step=4, model=loaded, block_size=BLOCK)
    with hook.attached(loaded.model), torch.no_grad():
        hooked = loaded.model.generate(
            ids, max_new_tokens=12, do_sample=False, logits_processor=[hook]
        )
    assert torch.equal(plain, hooked)
    dumped, token_ids = kt.restore_dynamic_cache(hook.path, model=loaded, device="cuda")
    assert token_ids == hooked[0, : ids.shape[1] + 4].tolist()
    for final, copy in zip(hook.cache.layers, dumped.layers, strict=True):
        assert torch.equal(final.keys[:, :, : len(token_ids)], copy.keys)
        assert torch.equal(final.values[:, :, : len(token_ids)], copy.values)


def test_paged_prefix_moves_between_cuda_engines_exactly(loaded: Any, tmp_path: Path) -> None:
    from kvsnap.engines import transformers as kt

    ids = loaded.encode(PROMPT)
    path = tmp_path / "prefix.safetensors"
    with manager_for(loaded, NEW_TOKENS) as first:
        first.start()
        run_request(first, ids, NEW_TOKENS)
        # The second run takes the prompt's complete blocks from the engine's own prefix cache:
        # the same shapes the restored engine below runs.
        reference = run_request(first, ids, NEW_TOKENS)
        result = kt.capture_paged_prefix(first, {"prompt": ids}, path, model=loaded)
    assert result.num_tokens == (len(ids) // BLOCK) * BLOCK

    with manager_for(loaded, NEW_TOKENS) as second:
        restored = kt.restore_paged_cache(path, second, model=loaded)
        assert restored.prefix_tokens == result.num_tokens
        second.start()
        assert run_request(second, ids, NEW_TOKENS) == reference
