"""Cache identity: weights fingerprints, and store keys that separate every identity."""

from __future__ import annotations

import copy
import gc
import hashlib
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.engines.default_model import build_default_model
from kvsnap.engines.vllm.engine_config import model_fingerprint as vllm_model_fingerprint
from kvsnap.engines.vllm.identity import (
    CacheIdentity,
    MultimodalInput,
    adapter_digest,
    identity_of,
    store_key_chain,
)
from kvsnap.engines.weights import (
    checkpoint_weights_fingerprint,
    loaded_model_fingerprint,
    module_weights_fingerprint,
)
from kvsnap.format import bfloat16_bits, model_fingerprint_with_weights

BLOCK = 4


@pytest.fixture(scope="module")
def base_model() -> torch.nn.Module:
    return build_default_model()


def fine_tune(model: torch.nn.Module, name: str, scale: float) -> torch.nn.Module:
    """A copy of ``model`` with one weight tensor scaled: a fine-tune of the same architecture."""
    tuned = build_default_model()
    tuned.load_state_dict(model.state_dict())
    with torch.no_grad():
        tuned.get_parameter(name).mul_(scale)
    return tuned


# -- weights ---------------------------------------------------------------------------------


def test_a_fine_tune_of_the_same_architecture_has_another_fingerprint(base_model) -> None:
    tuned = fine_tune(base_model, "model.layers.1.self_attn.k_proj.weight", 1.01)
    assert tuned.config.to_dict() == base_model.config.to_dict()
    assert loaded_model_fingerprint(tuned) != loaded_model_fingerprint(base_model)


def test_a_change_in_place_is_seen_by_the_remembered_fingerprint() -> None:
    model = build_default_model()
    before = module_weights_fingerprint(model)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    assert module_weights_fingerprint(model) != before


def test_a_replaced_module_or_parameter_is_seen_by_the_remembered_fingerprint() -> None:
    model = build_default_model()
    first = loaded_model_fingerprint(model)
    attention = model.model.layers[0].self_attn
    # What an adapter library does: a projection swapped for a module of its own.
    attention.k_proj = torch.nn.Linear(attention.k_proj.in_features, attention.k_proj.out_features)
    second = loaded_model_fingerprint(model)
    assert second != first
    weight = model.model.layers[1].self_attn.v_proj.weight
    model.model.layers[1].self_attn.v_proj.weight = torch.nn.Parameter(weight.detach() * 2)
    assert loaded_model_fingerprint(model) not in (first, second)


def test_a_remembered_fingerprint_lets_the_model_go() -> None:
    # The remembered state is the value of a map keyed weakly by the model: it must not hold
    # the model (or any module of it) itself, or no fingerprinted model would ever be freed.
    model = build_default_model()
    loaded_model_fingerprint(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_files_and_the_loaded_model_agree_in_any_float_dtype(base_model, tmp_path: Path) -> None:
    base_model.save_pretrained(tmp_path / "f32")
    build_default_model(dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = module_weights_fingerprint(base_model)
    assert checkpoint_weights_fingerprint(tmp_path / "f32") == loaded
    assert checkpoint_weights_fingerprint(tmp_path / "bf16") == loaded
    assert module_weights_fingerprint(build_default_model(dtype=torch.bfloat16)) == loaded


def test_a_quantization_applied_at_load_is_another_served_model(base_model, tmp_path) -> None:
    """vLLM's ``--quantization fp8`` on bf16 weights computes other KV from the same config
    and files: another fingerprint (and store namespace). A checkpoint quantized ahead says so
    in its own config, and an unquantized model's fingerprint is what it always was."""
    base_model.save_pretrained(tmp_path)

    def served(quantization: str | None, config: object = base_model.config) -> SimpleNamespace:
        model = SimpleNamespace(
            model=str(tmp_path), revision=None, quantization=quantization, hf_config=config
        )
        return SimpleNamespace(model_config=model)

    weights = checkpoint_weights_fingerprint(tmp_path)
    plain = vllm_model_fingerprint(served(None))  # type: ignore[arg-type]
    assert plain == model_fingerprint_with_weights(base_model.config.to_dict(), weights)
    assert vllm_model_fingerprint(served("fp8")) != plain  # type: ignore[arg-type]
    assert vllm_model_fingerprint(served("fp8")) != vllm_model_fingerprint(served("int8"))  # type: ignore[arg-type]
    quantized = copy.deepcopy(base_model.config)
    quantized.quantization_config = {"quant_method": "fp8"}
    ahead = vllm_model_fingerprint(served(None, quantized))  # type: ignore[arg-type]
    assert ahead != plain
    assert vllm_model_fingerprint(served("fp8", quantized)) == ahead  # type: ignore[arg-type]


def test_a_full_content_fingerprint_sees_a_change_between_samples(base_model) -> None:
    # One element far from every sampled window of a large tensor.
    name = "model.embed_tokens.weight"
    tuned = build_default_model()
    tuned.load_state_dict(base_model.state_dict())
    with torch.no_grad():
        flat = tuned.get_parameter(name).view(-1)
        flat[flat.numel() // 2 + 7] += 1.0
    assert module_weights_fingerprint(tuned) == module_weights_fingerprint(base_model)
    full = module_weights_fingerprint(tuned, full=True)
    assert full != module_weights_fingerprint(base_model, full=True)


def test_a_directory_without_safetensors_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_weights_fingerprint(tmp_path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_bfloat16_bits_round_as_torch_does(values: list[float]) -> None:
    array = np.array(values, dtype=np.float32)
    expected = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(bfloat16_bits(array).view(np.int16), expected)


# -- store keys ------------------------------------------------------------------------------


def test_keys_are_sha256_and_identify_the_whole_prefix() -> None:
    tokens = np.arange(12)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    assert len(chain) == 3 and all(len(key) == 64 for key in chain)
    assert store_key_chain(tokens[:8], BLOCK, CacheIdentity()) == chain[:2]
    changed = tokens.copy()
    changed[1] = 99
    other = store_key_chain(changed, BLOCK, CacheIdentity())
    assert not set(other) & set(chain)
    # A partial block never equals a full one.
    assert store_key_chain(tokens[:10], BLOCK, CacheIdentity())[2] != chain[2]


def _key_field(text: str | None) -> bytes:
    """A nullable text field as the key definition feeds it: a presence byte, then the
    UTF-8 bytes' length (little-endian int64) and the bytes."""
    if text is None:
        return b"\0"
    raw = text.encode()
    return b"\1" + len(raw).to_bytes(8, "little") + raw


def _keys_by_definition(tokens: np.ndarray, block: int, identity: CacheIdentity) -> list[str]:
    """The store keys as docs/vllm.md and ``store_key_chain``'s docstring define them, written
    out byte by byte: what the stored chunks' names depend on."""
    fields = (identity.lora_name, identity.lora_digest, identity.cache_salt)
    root = b"kvsnap-identity-v2\0" + b"".join(_key_field(value) for value in fields)
    previous = hashlib.sha256(root).digest()
    keys = []
    for start in range(0, len(tokens), block):
        piece = tokens[start : start + block]
        inputs = [
            item
            for item in identity.multimodal
            if item.offset < start + len(piece) and item.offset + item.length > start
        ]
        message = b"kvsnap-prefix-key-v2\0" + previous + len(piece).to_bytes(8, "little")
        message += piece.astype("<i8").tobytes() + len(inputs).to_bytes(8, "little")
        for item in inputs:
            message += _key_field(item.identifier) + item.offset.to_bytes(8, "little", signed=True)
            message += item.length.to_bytes(8, "little", signed=True)
        previous = hashlib.sha256(message).digest()
        keys.append(previous.hex())
    return keys


#: Keys of fixed inputs as main at c2252b4 computed them (before a block was hashed with one
#: digest call): a store written by any earlier kvsnap names its chunks by exactly these.
_PINNED_KEYS = {
    "plain": [
        "6e7118b0d48c504da72a0a8a98c3eba098455331967a97e36a4b39abdab05775",
        "e8fe10360cadd69199b8e9aba8d1ed07d93053d9646abc7bce5b56870af110d2",
        "97cc21162152aaa821347309c0199429a7003f66af2f5b0682342d25e4e53522",
    ],
    "lora and salt": [
        "32bcd7bc689f9906f819079c1ffa8627a859cc07dc9d7742f5fcfddf106ba9d5",
        "5a6a597f9382a6d39ff825a24a8a4f48bc32c975850e3c654d233f762d56834e",
        "7f64f794712c9589f2edd803b7b9d6a6d8e575e58262d87d499a4103a1ed0bf1",
    ],
    "multimodal": [
        "67e0b9f42667fc288b36aa8dae9b52e3b19fce7d1610214a4a485a50e39337f5",
        "0457afe6773f8036e8d11acba6a05afc1365991d6ceed306c476c21806153b4b",
        "5fec76c77f1284932905179e53122d769325382368afd498e226bf11b4c3103d",
    ],
}
_PINNED_IDENTITIES = {
    "plain": CacheIdentity(),
    "lora and salt": CacheIdentity(lora_name="sql", lora_digest="ab" * 32, cache_salt="tenant-1"),
    "multimodal": CacheIdentity(
        multimodal=(MultimodalInput("img-1", 2, 3), MultimodalInput("", 9, 1))
    ),
}


@pytest.mark.parametrize("name", sorted(_PINNED_KEYS))
def test_store_keys_keep_their_exact_bytes(name: str) -> None:
    # 10 tokens in blocks of 4: two full blocks and a partial one, negative ids included.
    tokens = np.arange(10) * 7919 - 3
    identity = _PINNED_IDENTITIES[name]
    assert store_key_chain(tokens, BLOCK, identity) == _PINNED_KEYS[name]
    assert _keys_by_definition(tokens, BLOCK, identity) == _PINNED_KEYS[name]


def test_store_keys_follow_their_definition_on_random_prompts() -> None:
    generator = np.random.default_rng(26)
    for _ in range(200):
        tokens = generator.integers(-(2**40), 2**40, size=int(generator.integers(0, 70)))
        block = int(generator.integers(1, 17))
        multimodal = tuple(
            MultimodalInput(f"m{index}-{'x' * index}", int(offset), int(length))
            for index, (offset, length) in enumerate(generator.integers(0, 40, size=(3, 2)))
        )
        identity = CacheIdentity(
            lora_name=str(generator.integers(9)) if generator.random() < 0.5 else None,
            lora_digest="é" if generator.random() < 0.3 else None,
            cache_salt="" if generator.random() < 0.3 else None,
            multimodal=multimodal[: int(generator.integers(0, 4))],
        )
        assert store_key_chain(tokens, block, identity) == _keys_by_definition(
            tokens, block, identity
        )


@pytest.mark.parametrize(
    "identity",
    [
        CacheIdentity(lora_name="a", lora_digest="0" * 64),
        CacheIdentity(lora_name="a", lora_digest="1" * 64),
        CacheIdentity(lora_name="b", lora_digest="0" * 64),
        CacheIdentity(cache_salt="tenant-1"),
        CacheIdentity(cache_salt=""),
        CacheIdentity(multimodal=(MultimodalInput("image-1", 1, 2),)),
        CacheIdentity(multimodal=(MultimodalInput("image-2", 1, 2),)),
        CacheIdentity(multimodal=(MultimodalInput("image-1", 2, 2),)),
    ],
)
def test_every_part_of_the_identity_changes_every_key(identity: CacheIdentity) -> None:
    tokens = np.arange(12)
    plain = store_key_chain(tokens, BLOCK, CacheIdentity())
    keys = store_key_chain(tokens, BLOCK, identity)
    assert all(mine != theirs for mine, theirs in zip(keys, plain, strict=True))


def test_a_multimodal_input_changes_keys_from_its_block_on() -> None:
    tokens = np.arange(12)
    plain = store_key_chain(tokens, BLOCK, CacheIdentity())
    image = CacheIdentity(multimodal=(MultimodalInput("image", 5, 2),))
    keys = store_key_chain(tokens, BLOCK, image)
    assert keys[0] == plain[0]
    assert keys[1] != plain[1] and keys[2] != plain[2]


def test_fields_cannot_be_shifted_into_each_other() -> None:
    # "ab" + None and "a" + "b" would meet under a plain concatenation.
    tokens = np.arange(4)
    first = store_key_chain(tokens, BLOCK, CacheIdentity(lora_name="ab"))
    second = store_key_chain(tokens, BLOCK, CacheIdentity(lora_name="a", lora_digest="b"))
    assert first != second


def test_adapter_digest_follows_the_files_content(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\x01" * 1000)
    first = adapter_digest(adapter)
    weights.write_bytes(b"\x02" * 1000)  # retrained under the same name and path
    assert adapter_digest(adapter) != first
    assert len(first) == 64 and first == first.lower()


def test_identity_of_reads_a_vllm_shaped_request(tmp_path: Path) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    request = SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(adapter)),
        cache_salt="tenant",
        mm_features=[
            SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=3, length=4))
        ],
    )
    identity = identity_of(request)
    assert identity == CacheIdentity(
        "sql",
        adapter_digest(adapter),
        "tenant",
        (MultimodalInput("img", 3, 4),),
    )
    assert (
        identity.lora_digest
        == hashlib.sha256(
            b"kvsnap-adapter-v1\0"
            + _field("adapter_model.safetensors")
            + (7).to_bytes(8, "little")
            + b"weights"
        ).hexdigest()
    )
    plain = SimpleNamespace(lora_request=None, cache_salt=None, mm_features=None)
    assert identity_of(plain) == CacheIdentity()


def _field(text: str) -> bytes:
    raw = text.encode()
    return b"\1" + len(raw).to_bytes(8, "little") + raw
