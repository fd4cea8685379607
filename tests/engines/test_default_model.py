"""The built-in model and model loading: deterministic weights, byte tokenizer, offline loading."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.engines.default_model import (
    DEFAULT_MODEL_ID,
    TINY_LLAMA_CONFIG,
    ByteTokenizer,
    LoadedModel,
    ModelLoadError,
    build_default_model,
    load_model,
)
from kvsnap.engines.weights import module_weights_fingerprint
from kvsnap.errors import KVSnapError
from kvsnap.format import model_fingerprint, model_fingerprint_with_weights

#: sha256 over (name, fp32 bytes) of every weight of the built-in model, sorted by name. Pinned
#: so the model stays identical across machines and library versions: snapshots captured on
#: one machine restore on another only if this holds. Checked equal under transformers 5.17
#: and 5.24 with torch 2.13 (weights come from SHAKE-256, not from a torch generator).
BUILTIN_WEIGHTS_SHA256 = "16fe8b4662177e9f611653e528023690eb5c62bf83a457d4b61a0ada22e38224"


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return output[0, len(ids) :].tolist()


def test_builtin_model_has_the_documented_gqa_shape(loaded: LoadedModel) -> None:
    config = loaded.model.config
    assert loaded.model_id == DEFAULT_MODEL_ID
    assert config.num_hidden_layers == 4
    assert config.hidden_size == 128
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 2  # GQA: fewer KV heads than attention heads
    assert config.head_dim == 32
    assert config.vocab_size == 256 + 3
    assert loaded.dtype == torch.float32
    assert loaded.device.type == "cpu"


def test_builtin_weights_are_pinned_and_ignore_torch_global_rng(loaded: LoadedModel) -> None:
    assert weights_digest(loaded.model) == BUILTIN_WEIGHTS_SHA256
    torch.manual_seed(12345)
    first = build_default_model()
    torch.manual_seed(54321)
    second = build_default_model()
    assert weights_digest(first) == weights_digest(second) == BUILTIN_WEIGHTS_SHA256


def test_builtin_model_generates_deterministic_varied_text(loaded: LoadedModel) -> None:
    ids = loaded.encode("kvsnap snapshots the KV cache")
    first = greedy(loaded.model, ids, 48)
    second = greedy(build_default_model(), ids, 48)
    assert first == second
    assert len(first) == 48
    # Not degenerate: a random model stuck on one token would make continuation tests vacuous.
    assert len(set(first)) >= 12


def test_fingerprint_covers_the_config_and_the_weights(loaded: LoadedModel) -> None:
    weights = module_weights_fingerprint(loaded.model)
    assert loaded.fingerprint == model_fingerprint_with_weights(loaded.model.config, weights)
    assert len(loaded.fingerprint) == 32
    assert load_model().fingerprint == loaded.fingerprint
    assert load_model(dtype=torch.bfloat16).fingerprint == loaded.fingerprint
    changed = dict(loaded.model.config.to_dict(), num_key_value_heads=4)
    assert model_fingerprint_with_weights(changed, weights) != loaded.fingerprint
    assert model_fingerprint(loaded.model.config) != loaded.fingerprint


def test_dtype_argument_converts_every_parameter() -> None:
    loaded = load_model(dtype=torch.bfloat16)
    assert {param.dtype for param in loaded.model.parameters()} == {torch.bfloat16}
    # Same weights, rounded: bf16 keeps 8 bits of mantissa.
    reference = build_default_model()
    for (name, low), (_, high) in zip(
        sorted(loaded.model.state_dict().items()),
        sorted(reference.state_dict().items()),
        strict=True,
    ):
        torch.testing.assert_close(low.float(), high, rtol=1e-2, atol=1e-2, msg=name)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_bos=False) == ids[1:]


def test_byte_tokenizer_decode_skips_specials_and_survives_garbage() -> None:
    tokenizer = ByteTokenizer()
    hello = list(b"hi")
    ids = [
        tokenizer.bos_token_id,
        *hello,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        -1,
        300,
        999,
    ]
    assert tokenizer.decode(ids) == "hi"
    # A lone continuation byte and a truncated 3-byte sequence are not UTF-8: replaced, no error.
    assert tokenizer.decode([0x80, ord("a"), 0xE2, 0x82]) == "\ufffda\ufffd"
    assert tokenizer.decode([]) == ""


def test_loaded_model_encode_decode_use_the_byte_tokenizer(loaded: LoadedModel) -> None:
    text = "naïve café ☕"
    ids = loaded.encode(text)
    assert ids == [256, *text.encode("utf-8")]
    assert loaded.decode(ids) == text


def test_load_model_from_a_saved_directory_matches_the_builtin(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    loaded.model.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path))
    assert isinstance(reloaded.tokenizer, ByteTokenizer)  # the directory has no tokenizer files
    assert reloaded.fingerprint == loaded.fingerprint
    assert weights_digest(reloaded.model) == BUILTIN_WEIGHTS_SHA256
    ids = loaded.encode("same model, loaded from disk")
    assert greedy(reloaded.model, ids, 16) == greedy(loaded.model, ids, 16)


def test_load_model_uses_the_directory_tokenizer_when_it_has_one(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 5, "world": 7}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]").save_pretrained(
        tmp_path
    )
    loaded.model.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path))
    assert not isinstance(reloaded.tokenizer, ByteTokenizer)
    assert reloaded.encode("hello world") == [5, 7]
    assert reloaded.decode([5, 7]) == "hello world"


def test_load_model_refuses_a_missing_model_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("no-such-org/no-such-model", str(tmp_path / "missing-dir")):
        with pytest.raises(ModelLoadError) as caught:
            load_model(name)
        message = str(caught.value)
        assert name in message
        assert "\n" not in message
        assert isinstance(caught.value, KVSnapError)
        assert isinstance(caught.value, ValueError)


def test_load_model_refuses_a_vocabulary_too_small_for_byte_ids(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    small = dict(TINY_LLAMA_CONFIG, vocab_size=100, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="too small for byte ids"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "name", ["{tmp}/no-model", "./no-model", "~/no-model", "a/b/c", "{tmp_name}/no-model"]
)
def test_a_missing_model_directory_is_named_as_such(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path.parent)  # "{tmp_name}/..." starts with an existing directory
    name = name.format(tmp=tmp_path, tmp_name=tmp_path.name)
    with pytest.raises(KVSnapError, match=f"^model directory {re.escape(name)} does not exist$"):
        load_model(name)


def test_a_hub_id_missing_from_the_cache_is_reported_as_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(KVSnapError, match="hub id"):
        load_model("some-org/some-model")
