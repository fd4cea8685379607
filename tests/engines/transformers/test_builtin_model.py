"""kvsnap with transformers, on the built-in model: DynamicCache, continuous batching, dump hook.

The claim under test everywhere: a snapshot restores bit-identical KV, and greedy generation
continued from restored KV produces exactly the tokens an uninterrupted run produces — for a
DynamicCache, for continuous batching's PagedAttentionCache, and across the two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import (
    TINY_LLAMA_CONFIG,
    ByteTokenizer,
    LoadedModel,
    load_model,
)
from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.format import model_fingerprint
from kvsnap.layout import LayoutError
from kvsnap.snapshot import Snapshot

BLOCK = 16
PROMPT = "kvsnap restores the KV cache exactly."  # 38 tokens with BOS: a partial last block
LONG_PROMPT = "kvsnap restores the KV cache exactly, bit for bit."  # 51 tokens: 3 full blocks + 3
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def hf_greedy(loaded: LoadedModel, ids: list[int], new_tokens: int) -> list[int]:
    """The uninterrupted reference: transformers' own greedy ``generate`` from the prompt."""
    with torch.no_grad():
        output = loaded.model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False
        )
    return output[0, len(ids) :].tolist()


def cb_config(**extra: Any) -> ContinuousBatchingConfig:
    """A small CPU continuous-batching config with 16-token pages (5.17 calls them block_size)."""
    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    size_name = "page_size" if "page_size" in fields else "block_size"
    return ContinuousBatchingConfig(
        num_blocks=64, max_batch_tokens=256, use_async_batching=False, **{size_name: BLOCK}, **extra
    )


def greedy_config(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)


@contextmanager
def manager_for(loaded: LoadedModel, new_tokens: int, **cb_extra: Any) -> Iterator[Any]:
    """A continuous-batching manager, not started; always stopped and destroyed afterwards.

    Stopping matters beyond the thread: a manager switches the model to paged attention and
    switches it back when it stops.
    """
    attention = loaded.model.config._attn_implementation
    manager = loaded.model.init_continuous_batching(
        generation_config=greedy_config(new_tokens),
        continuous_batching_config=cb_config(**cb_extra),
    )
    try:
        yield manager
    finally:
        if manager.is_running():
            manager.stop(block=True)
        manager.destroy()
        # A manager that never started does not switch the attention back when destroyed.
        if loaded.model.config._attn_implementation != attention:
            loaded.model.set_attn_implementation(attention)


def run_request(manager: Any, ids: list[int], new_tokens: int) -> list[int]:
    request_id = manager.add_request(ids, max_new_tokens=new_tokens)
    for output in manager.request_id_iter(request_id):
        if output.is_finished():
            assert output.error is None, output.error
            return list(output.generated_tokens)
    raise AssertionError("the continuous batching loop ended before the request finished")


def spy_prefix_matches(cache: Any) -> list[int]:
    """Record how many prompt tokens each new request takes from the prefix cache."""
    matched: list[int] = []
    original = cache.search_prefix_match

    def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
        result = original(request_id, prompt_ids)
        matched.append(result)
        return result

    cache.search_prefix_match = search_prefix_match
    return matched


def layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


# ---------------------------------------------------------------------------------------------
# Geometry


def test_geometry_for_model_describes_the_builtin_cache(loaded: LoadedModel) -> None:
    geometry = kt.geometry_for_model(loaded, BLOCK)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (4, 2, 32)
    assert (geometry.block_size, geometry.dtype) == (BLOCK, "float32")
    assert geometry.attention_types == ("full",) * 4
    assert kt.geometry_for_model(loaded.model, 32, torch.bfloat16).dtype == "bfloat16"
    hybrid = LlamaConfig(**TINY_LLAMA_CONFIG)
    hybrid.layer_types = ["sliding_attention", "full_attention"] * 2
    assert (
        kt.geometry_for_model(hybrid, BLOCK, "float16").attention_types == ("sliding", "full") * 2
    )
    with pytest.raises(ValueError, match="needs a dtype"):
        kt.geometry_for_model(hybrid, BLOCK)


# ---------------------------------------------------------------------------------------------
# DynamicCache


def test_dynamic_round_trip_is_bit_exact_and_continues_like_an_uninterrupted_run(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    [(cache, ids)] = kt.prefill(loaded, [PROMPT])
    assert len(ids) % BLOCK != 0
    reference = hf_greedy(loaded, ids, NEW_TOKENS)
    path = tmp_path / "prompt.safetensors"
    result = kt.capture_dynamic_cache(cache, [ids], path, model=loaded, block_size=BLOCK)
    assert (result.num_sequences, result.num_tokens, result.num_blocks) == (1, len(ids), 3)

    restored, token_ids = kt.restore_dynamic_cache(path, model=loaded)
    assert token_ids == ids
    assert restored.get_seq_length() == len(ids)
    for (keys, values), (restored_keys, restored_values) in zip(
        layer_kv(cache), layer_kv(restored), strict=True
    ):
        assert torch.equal(keys, restored_keys)
        assert torch.equal(values, restored_values)
    assert kt.continue_generation(loaded, restored, token_ids, NEW_TOKENS) == reference


def test_dynamic_snapshot_holds_canonical_pages_any_safetensors_reader_sees(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    [(cache, ids)] = kt.prefill(loaded, [PROMPT])
    path = tmp_path / "prompt.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=loaded, block_size=BLOCK)
    with safe_open(str(path), framework="pt") as handle:
        for layer, (keys, values) in enumerate(layer_kv(cache)):
            for part, source in (("key", keys), ("value", values)):
                pages = handle.get_tensor(f"layers.{layer}.{part}")  # (blocks, tokens, heads, dim)
                assert pages.shape == (3, BLOCK, 2, 32)
                tokens = pages.reshape(3 * BLOCK, 2, 32)
                assert torch.equal(tokens[: len(ids)], source[0].transpose(0, 1))
                assert not tokens[len(ids) :].any()  # the partial block is zero-padded


def test_left_padded_batch_rows_become_separate_sequences(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(7)
    cache = DynamicCache()
    states = []
    for layer in range(3):
        keys = torch.randn(2, 2, 20, 8, generator=generator).half()
        values = torch.randn(2, 2, 20, 8, generator=generator).half()
        cache.update(keys, values, layer)
        states.append((keys, values))
    rows = [list(range(100, 120)), list(range(200, 213))]  # the second row is left-padded by 7
    path = tmp_path / "batch.safetensors"
    result = kt.capture_dynamic_cache(
        cache, rows, path, model=None, block_size=8, sequence_ids=["long", "short"]
    )
    assert result.num_blocks == 3 + 2
    with Snapshot.open(path) as snapshot:
        assert snapshot.metadata.source.model_fingerprint == ""
        for row, (name, tokens) in enumerate(zip(["long", "short"], rows, strict=True)):
            restored, token_ids = kt.restore_dynamic_cache(snapshot, sequence_id=name)
            assert token_ids == tokens
            for (keys, values), (restored_keys, restored_values) in zip(
                states, layer_kv(restored), strict=True
            ):
                assert restored_keys.dtype == torch.float16
                assert torch.equal(restored_keys[0], keys[row, :, 20 - len(tokens) :])
                assert torch.equal(restored_values[0], values[row, :, 20 - len(tokens) :])
        with pytest.raises(ValueError, match="name one"):
            kt.restore_dynamic_cache(snapshot)


def test_continue_generation_resumes_from_any_prefix_of_the_tokens(loaded: LoadedModel) -> None:
    ids = loaded.encode(PROMPT)
    reference = hf_greedy(loaded, ids, 12)
    for cached in (0, 1, 20, len(ids) - 1, len(ids)):
        cache = kt.new_dynamic_cache(loaded)
        if cached:
            kt.forward_with_cache(loaded, ids[:cached], cache)
        assert kt.continue_generation(loaded, cache, ids, 12) == reference, cached
    too_long = kt.new_dynamic_cache(loaded)
    kt.forward_with_cache(loaded, ids, too_long)
    with pytest.raises(ValueError, match="more than"):
        kt.continue_generation(loaded, too_long, ids[:10], 4)
    stop_on = reference[3]
    cache = kt.new_dynamic_cache(loaded)
    assert kt.continue_generation(loaded, cache, ids, 12, eos_token_id=stop_on) == reference[:4]


def test_restore_refuses_a_model_the_snapshot_does_not_fit(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    [(cache, ids)] = kt.prefill(loaded, [PROMPT])
    path = tmp_path / "prompt.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=loaded, block_size=BLOCK)

    def wrap(**changes: Any) -> LoadedModel:
        config = LlamaConfig(**dict(TINY_LLAMA_CONFIG, **changes))
        config.architectures = ["LlamaForCausalLM"]
        return LoadedModel(
            LlamaForCausalLM(config).eval(),
            ByteTokenizer(),
            "other",
            None,
            model_fingerprint(config),
        )

    with pytest.raises(IncompatibleSnapshotError, match="num_kv_heads: snapshot 2, target 4"):
        kt.restore_dynamic_cache(path, model=wrap(num_key_value_heads=4))
    with pytest.raises(
        IncompatibleSnapshotError, match="dtype: snapshot 'float32', target 'bfloat16'"
    ):
        kt.restore_dynamic_cache(path, model=load_model(dtype=torch.bfloat16))
    same_geometry = wrap(intermediate_size=512)
    with pytest.raises(IncompatibleSnapshotError, match="a forced restore skips"):
        kt.restore_dynamic_cache(path, model=same_geometry)
    forced, _ = kt.restore_dynamic_cache(path, model=same_geometry, force=True)
    assert torch.equal(forced.layers[0].keys, cache.layers[0].keys)
    # An explicit dtype casts after the bit-exact restore, so a bf16 model can take fp32 KV.
    cast, _ = kt.restore_dynamic_cache(
        path, model=load_model(dtype=torch.bfloat16), dtype=torch.bfloat16
    )
    assert torch.equal(cast.layers[3].values, cache.layers[3].values.bfloat16())


def test_sliding_window_dynamic_layers_are_refused() -> None:
    cache = DynamicCache(config=_sliding_config(sliding_window=8))
    states = torch.zeros(1, 2, 12, 32)
    for layer in range(4):
        cache.update(states, states, layer)
    with pytest.raises(LayoutError, match="sliding window"):
        kt.dynamic_cache_states(cache)


def _sliding_config(sliding_window: int) -> Any:
    from transformers import MistralConfig

    config = MistralConfig(**dict(TINY_LLAMA_CONFIG, sliding_window=sliding_window))
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    return config


# ---------------------------------------------------------------------------------------------
# The dump hook inside generate()


def test_dump_hook_leaves_generate_unchanged_and_dumps_that_steps_kv(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    ids = torch.tensor([loaded.encode(LONG_PROMPT)])
    step = 5
    with torch.no_grad():
        plain = loaded.model.generate(ids, max_new_tokens=12, do_sample=False)
    path = tmp_path / "step5.safetensors"
    hook = kt.KVDumpHook(path, step=step, model=loaded, block_size=BLOCK)
    with hook.attached(loaded.model), torch.no_grad():
        hooked = loaded.model.generate(
            ids, max_new_tokens=12, do_sample=False, logits_processor=[hook]
        )
    assert torch.equal(plain, hooked)
    assert hook.result is not None
    dumped_tokens = hooked[0, : ids.shape[1] + step].tolist()
    dumped, token_ids = kt.restore_dynamic_cache(path, model=loaded)
    assert token_ids == dumped_tokens

    # Bit-exact: the dump is the cache generate itself holds (its first tokens never change).
    final = layer_kv(hook.cache)
    for (keys, values), (dumped_keys, dumped_values) in zip(final, layer_kv(dumped), strict=True):
        assert torch.equal(keys[:, :, : len(dumped_tokens)], dumped_keys)
        assert torch.equal(values[:, :, : len(dumped_tokens)], dumped_values)

    # A prefill of the same tokens agrees within fp32 rounding, not bit for bit: generate built
    # the last `step` tokens' KV one token per forward pass, a prefill builds all of them in one
    # pass, and matmuls over a different number of rows sum in a different order.
    prefilled = kt.new_dynamic_cache(loaded)
    kt.forward_with_cache(loaded, dumped_tokens, prefilled)
    for (keys, values), (dumped_keys, dumped_values) in zip(
        layer_kv(prefilled), layer_kv(dumped), strict=True
    ):
        torch.testing.assert_close(dumped_keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dumped_values, values, rtol=1e-5, atol=1e-5)


def test_dump_at_step_returns_generates_output_and_refuses_unreached_steps(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    ids = loaded.encode(PROMPT)
    output, result = kt.dump_at_step(
        loaded, ids, 0, tmp_path / "prefill.safetensors", max_new_tokens=6, do_sample=False
    )
    assert output[0, len(ids) :].tolist() == hf_greedy(loaded, ids, 6)
    assert result.num_tokens == len(ids)  # step 0: the prompt's prefill
    with pytest.raises(ValueError, match="before step 9"):
        kt.dump_at_step(
            loaded, ids, 9, tmp_path / "late.safetensors", max_new_tokens=4, do_sample=False
        )
    hook = kt.KVDumpHook(tmp_path / "detached.safetensors", step=0)
    with pytest.raises(ValueError, match="attached"), torch.no_grad():
        loaded.model.generate(torch.tensor([ids]), max_new_tokens=2, logits_processor=[hook])


# ---------------------------------------------------------------------------------------------
# Continuous batching (PagedAttentionCache)


def test_dynamic_snapshot_resumes_in_a_fresh_continuous_batching_engine(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    [(cache, ids)] = kt.prefill(loaded, [LONG_PROMPT])
    reference = hf_greedy(loaded, ids, NEW_TOKENS)
    path = tmp_path / "prefix.safetensors"
    kt.capture_dynamic_cache(cache, [ids], path, model=loaded, block_size=BLOCK)

    with manager_for(loaded, NEW_TOKENS) as manager:
        restored = kt.restore_paged_cache(path, manager, model=loaded)
        assert restored.token_ids == ids
        assert restored.prefix_tokens == 48  # 3 complete blocks; the partial one is recomputed
        matched = spy_prefix_matches(manager.batch_processor.cache)
        manager.start()
        generated = run_request(manager, ids, NEW_TOKENS)
    assert matched == [48]  # the engine took the restored blocks instead of prefilling them
    assert generated == reference

    # Control: the same resume from deliberately wrong KV gives other tokens, so the restored
    # blocks really are what the engine read.
    for layer in cache.layers:
        layer.keys.add_(0.5)
    wrong = tmp_path / "wrong.safetensors"
    kt.capture_dynamic_cache(cache, [ids], wrong, model=loaded, block_size=BLOCK)
    with manager_for(loaded, NEW_TOKENS) as manager:
        kt.restore_paged_cache(wrong, manager, model=loaded)
        manager.start()
        assert run_request(manager, ids, NEW_TOKENS) != reference


def test_paged_restore_then_capture_is_bit_exact(loaded: LoadedModel, tmp_path: Path) -> None:
    [(cache, ids)] = kt.prefill(loaded, [LONG_PROMPT])
    original = tmp_path / "original.safetensors"
    kt.capture_dynamic_cache(cache, [ids], original, model=loaded, block_size=BLOCK)
    with manager_for(loaded, 1) as manager:
        restored = kt.restore_paged_cache(
            original, manager, request_id="held", as_prefix=False, model=loaded
        )
        adapter = kt.paged_cache_adapter(manager)
        assert adapter.block_table("held") == restored.block_ids
        assert restored.prefix_tokens == 0
        again = tmp_path / "again.safetensors"
        kt.capture_paged_cache(manager, ["held"], {"held": ids}, again, model=loaded)
        with pytest.raises(KeyError, match="held"):
            kt.capture_paged_cache(manager, ["nobody"], {"nobody": ids}, again, model=loaded)
    with Snapshot.open(original) as first, Snapshot.open(again) as second:
        assert second.sequences[0].id == "held"
        comparison = first.compare(second)  # exact: atol = rtol = 0
        assert comparison.ok, comparison.report()
        assert all(layer.max_abs_diff == 0.0 for layer in comparison.layers)


def test_live_request_captured_mid_generation_resumes_in_a_dynamic_cache(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    if not hasattr(ContinuousBatchingManager, "pause"):
        pytest.skip("this transformers cannot pause a running manager (5.17)")
    ids = loaded.encode(LONG_PROMPT)
    new_tokens = 40
    path = tmp_path / "live.safetensors"
    result = None
    with manager_for(loaded, new_tokens) as manager:
        manager.start()
        request_id = manager.add_request(ids, max_new_tokens=new_tokens, streaming=True)
        for output in manager.request_id_iter(request_id):
            if result is None and len(output.generated_tokens) >= 3:
                result = kt.capture_manager_requests(manager, [request_id], path, model=loaded)
            if output.is_finished():
                generated = list(output.generated_tokens)
                break
    assert result is not None
    full = ids + generated
    assert generated == hf_greedy(loaded, ids, new_tokens)  # capturing did not disturb the run
    restored, token_ids = kt.restore_dynamic_cache(path, model=loaded)
    assert len(ids) < len(token_ids) < len(full)
    assert token_ids == full[: len(token_ids)]
    # The snapshot holds exactly the tokens whose KV was in the cache: each one matches a prefill
    # (within fp32 rounding: the engine computed them in other batch shapes).
    prefilled = kt.new_dynamic_cache(loaded)
    kt.forward_with_cache(loaded, token_ids, prefilled)
    for (keys, values), (got_keys, got_values) in zip(
        layer_kv(prefilled), layer_kv(restored), strict=True
    ):
        torch.testing.assert_close(got_keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_values, values, rtol=1e-5, atol=1e-5)
    remaining = len(full) - len(token_ids)
    assert kt.continue_generation(loaded, restored, token_ids, remaining) == full[len(token_ids) :]


def test_cached_prefix_of_a_finished_run_moves_to_another_engine_and_to_a_dynamic_cache(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    ids = loaded.encode(LONG_PROMPT)
    path = tmp_path / "cached.safetensors"
    with manager_for(loaded, NEW_TOKENS) as manager:
        manager.start()
        generated = run_request(manager, ids, NEW_TOKENS)
        full = ids + generated  # 75 tokens; the last has no KV yet, so 4 complete blocks
        result = kt.capture_paged_prefix(manager, {"run": full}, path, model=loaded)
    assert result.num_tokens == 64
    reference = hf_greedy(loaded, full[:70], 16)

    # paged -> paged: a fresh engine resumes a longer prompt from the captured blocks.
    with manager_for(loaded, 16) as manager:
        assert kt.restore_paged_cache(path, manager, model=loaded).prefix_tokens == 64
        matched = spy_prefix_matches(manager.batch_processor.cache)
        manager.start()
        assert run_request(manager, full[:70], 16) == reference
    assert matched == [64]

    # paged -> dynamic.
    restored, token_ids = kt.restore_dynamic_cache(path, model=loaded)
    assert token_ids == full[:64]
    assert kt.continue_generation(loaded, restored, full[:70], 16) == reference


def test_paged_restore_refuses_before_allocating(loaded: LoadedModel, tmp_path: Path) -> None:
    [(cache, ids)] = kt.prefill(loaded, [PROMPT])
    small_blocks = tmp_path / "block8.safetensors"
    kt.capture_dynamic_cache(cache, [ids], small_blocks, model=loaded, block_size=8)
    fitting = tmp_path / "block16.safetensors"
    kt.capture_dynamic_cache(cache, [ids], fitting, model=loaded, block_size=BLOCK)
    with manager_for(loaded, 1, allow_block_sharing=False) as manager:
        adapter = kt.paged_cache_adapter(manager, create=True)
        free_before = kt.paged_cache_layout(manager).num_blocks, _free_blocks(adapter)
        with pytest.raises(IncompatibleSnapshotError, match="block_size: snapshot 8, target 16"):
            kt.restore_paged_cache(small_blocks, manager, as_prefix=False, model=loaded)
        with pytest.raises(LayoutError, match="allow_block_sharing"):
            kt.restore_paged_cache(fitting, manager, model=loaded)
        assert (kt.paged_cache_layout(manager).num_blocks, _free_blocks(adapter)) == free_before
        kept = kt.restore_paged_cache(
            fitting, manager, request_id="r", as_prefix=False, model=loaded
        )
        assert len(kept.block_ids) == 3
        assert _free_blocks(adapter) < free_before[1]


def _free_blocks(adapter: kt.PagedCacheAdapter) -> int:
    cache = adapter.cache
    if hasattr(cache, "pool"):  # 5.24: free sectors count in blocks, plus loose free blocks
        allocator = cache.cache_allocators["full_attention"]
        return (
            cache.pool.num_free_sectors * allocator.blocks_per_sector
            + cache.pool.count_free_blocks(allocator.index)
        )
    return cache.get_num_free_blocks()


def test_paged_caches_with_sliding_window_groups_are_refused() -> None:
    from transformers import MistralForCausalLM

    model = MistralForCausalLM(_sliding_config(sliding_window=32)).eval()
    manager = model.init_continuous_batching(
        generation_config=greedy_config(1), continuous_batching_config=cb_config()
    )
    try:
        with pytest.raises(LayoutError, match="sliding"):
            kt.paged_cache_adapter(manager, create=True)
    finally:
        manager.destroy()
