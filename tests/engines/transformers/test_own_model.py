"""kvsnap with a user's own transformers model (a plain ``PreTrainedModel``, no ``LoadedModel``),
and transformers' own ``generate`` continued from a restored cache.

The model is a real ``LlamaForCausalLM`` built from a config (random weights, no download), with
a larger init range than the default so that greedy decoding varies from token to token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvsnap.engines import transformers as kt
from kvsnap.engines.weights import loaded_model_fingerprint
from kvsnap.errors import IncompatibleSnapshotError
from kvsnap.snapshot import Snapshot

BLOCK = 4
PROMPT_TOKENS = 11  # two full blocks and a partial one
NEW_TOKENS = 16


def own_model(num_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.3,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # A random model would stop at a random EOS; greedy and no stop keep runs comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    return model


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return own_model()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, 97, (PROMPT_TOKENS,), generator=generator).tolist()


def uninterrupted(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    """transformers' own greedy ``generate`` from the prompt, without kvsnap."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return output[0].tolist()


def snapshot_of_prompt(model: LlamaForCausalLM, prompt: list[int], path: Path) -> Path:
    [(cache, ids)] = kt.prefill_token_ids(model, [prompt])
    kt.capture_dynamic_cache(cache, [ids], path, model=model, block_size=BLOCK)
    return path


def test_capture_with_a_plain_model_records_its_id_and_fingerprint(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    path = snapshot_of_prompt(model, prompt, tmp_path / "own.safetensors")
    with Snapshot.open(path) as snapshot:
        source = snapshot.metadata.source
        assert source.model_id == "LlamaForCausalLM"  # built from a config: no name_or_path
        assert source.model_fingerprint == loaded_model_fingerprint(model)
        assert source.engine == "transformers"


def test_model_id_is_the_configs_name_or_path_when_it_has_one(tmp_path: Path) -> None:
    model = own_model()
    model.config.name_or_path = "acme/own-llama"
    assert kt.model_id_of(model) == "acme/own-llama"
    assert kt.source_info(model).model_id == "acme/own-llama"


def test_restore_into_a_plain_model_checks_its_fingerprint(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    path = snapshot_of_prompt(model, prompt, tmp_path / "own.safetensors")
    restored, ids = kt.restore_dynamic_cache(path, model=model)
    assert ids == prompt and restored.get_seq_length() == PROMPT_TOKENS
    # Same geometry, different config (another vocabulary): refused unless forced.
    other = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "vocab_size": 98})).eval()
    with pytest.raises(IncompatibleSnapshotError, match="fingerprint"):
        kt.restore_dynamic_cache(path, model=other)
    kt.restore_dynamic_cache(path, model=other, force=True)
    with pytest.raises(IncompatibleSnapshotError):
        kt.check_snapshot_fits(Snapshot.open(path), own_model(num_layers=3))


def test_dump_at_step_and_the_hook_take_a_plain_model(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    output, result = kt.dump_at_step(
        model, prompt, 3, tmp_path / "step3.safetensors", block_size=BLOCK, max_new_tokens=6
    )
    assert output[0].tolist() == uninterrupted(model, prompt)[: PROMPT_TOKENS + 6]
    with Snapshot.open(result.path) as snapshot:
        assert snapshot.metadata.source.model_fingerprint == loaded_model_fingerprint(model)
        assert snapshot.sequences[0].token_ids.tolist() == output[0, : PROMPT_TOKENS + 3].tolist()
    hook = kt.KVDumpHook(tmp_path / "hook.safetensors", step=0, model=model, block_size=BLOCK)
    with hook.attached(model):
        model.generate(torch.tensor([prompt]), max_new_tokens=2, logits_processor=[hook])
    assert hook.result is not None


def test_generate_from_a_restored_cache_equals_an_uninterrupted_generate(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    reference = uninterrupted(model, prompt)
    assert len(set(reference[PROMPT_TOKENS:])) > 3, "the model should not repeat one token"
    path = snapshot_of_prompt(model, prompt, tmp_path / "own.safetensors")
    restored, ids = kt.restore_dynamic_cache(path, model=model)
    output = kt.generate_from_restored(
        model, restored, ids, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert output[0].tolist() == reference
    # The exact call it makes, for users who call generate themselves: drop the last token's
    # KV, then pass every token id.
    restored, ids = kt.restore_dynamic_cache(path, model=model)
    restored.crop(-1)
    with torch.no_grad():
        output = model.generate(
            torch.tensor([ids]), past_key_values=restored, max_new_tokens=NEW_TOKENS
        )
    assert output[0].tolist() == reference


def test_generate_from_a_cache_holding_a_shorter_prefix(
    model: LlamaForCausalLM, prompt: list[int]
) -> None:
    [(cache, _)] = kt.prefill_token_ids(model, [prompt[:5]])
    output = kt.generate_from_restored(model, cache, prompt, max_new_tokens=NEW_TOKENS)
    assert output[0].tolist() == uninterrupted(model, prompt)
    with pytest.raises(ValueError, match="more than"):
        kt.generate_from_restored(model, cache, prompt[:3], max_new_tokens=1)


def test_restore_allocates_every_layers_kv_once_and_capture_copies_into_one_buffer(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    path = snapshot_of_prompt(model, prompt, tmp_path / "own.safetensors")
    restored, _ = kt.restore_dynamic_cache(path, model=model)
    storages = {
        tensor.untyped_storage().data_ptr()
        for layer in restored.layers
        for tensor in (layer.keys, layer.values)
    }
    assert len(storages) == 1
    # And it is still exactly the prefilled KV.
    [(cache, _)] = kt.prefill_token_ids(model, [prompt])
    for original, back in zip(cache.layers, restored.layers, strict=True):
        assert torch.equal(original.keys, back.keys) and torch.equal(original.values, back.values)


def test_paged_restore_and_capture_take_a_plain_model(
    model: LlamaForCausalLM, prompt: list[int], tmp_path: Path
) -> None:
    original = snapshot_of_prompt(model, prompt, tmp_path / "own.safetensors")
    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    page = {"page_size" if "page_size" in fields else "block_size": BLOCK}  # 5.17: block_size
    attention = model.config._attn_implementation
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=16, max_batch_tokens=64, use_async_batching=False, **page
        ),
    )
    try:
        other = own_model(seed=1)
        other.config.vocab_size = 98  # another model of the same geometry
        with pytest.raises(IncompatibleSnapshotError, match="fingerprint"):
            kt.restore_paged_cache(original, manager, as_prefix=False, model=other)
        kt.restore_paged_cache(original, manager, request_id="held", as_prefix=False, model=model)
        again = tmp_path / "again.safetensors"
        kt.capture_paged_cache(manager, ["held"], {"held": prompt}, again, model=model)
    finally:
        manager.destroy()
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    with Snapshot.open(original) as first, Snapshot.open(again) as second:
        assert second.metadata.source.model_fingerprint == loaded_model_fingerprint(model)
        assert first.compare(second).ok


def test_prefill_of_a_plain_model_points_to_prefill_token_ids(model: LlamaForCausalLM) -> None:
    with pytest.raises(TypeError, match=r"prefill_token_ids\(model, token_id_lists\)"):
        kt.prefill(model, ["a prompt needs a tokenizer"])
    # What the message points to works on the same model.
    [(cache, ids)] = kt.prefill_token_ids(model, [[1, 2, 3]])
    assert ids == [1, 2, 3] and cache.get_seq_length() == 3
