"""Model fingerprints: stable across key order and volatile keys, equal for a transformers config
and its dict, refused for values without a stable text."""

from __future__ import annotations

import pytest

from kvsnap import format as fmt

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    "vocab_size": 1000,
}


def test_model_fingerprint_ignores_volatile_keys_and_order() -> None:
    base = fmt.model_fingerprint(CONFIG)
    assert len(base) == 32 and int(base, 16) >= 0
    noisy = dict(reversed(list(CONFIG.items())))
    noisy.update(
        _name_or_path="/home/someone/model",
        transformers_version="5.24.0",
        torch_dtype="bfloat16",
        _attn_implementation="sdpa",
        use_cache=False,
    )
    noisy["rope_scaling"] = {"factor": 8.0, "rope_type": "llama3", "_internal": 1}
    assert fmt.model_fingerprint(noisy) == base
    assert fmt.model_fingerprint({**CONFIG, "num_hidden_layers": 3}) != base
    assert (
        fmt.model_fingerprint({**CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 4.0}})
        != base
    )


def test_model_fingerprint_of_a_transformers_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        **{key: CONFIG[key] for key in ("hidden_size", "num_hidden_layers", "vocab_size")}
    )
    twin = transformers.LlamaConfig.from_dict(config.to_dict())
    twin._name_or_path = "elsewhere"
    assert (
        fmt.model_fingerprint(config)
        == fmt.model_fingerprint(twin)
        == fmt.model_fingerprint(config.to_dict())
    )
    other = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=2, vocab_size=1000)
    assert fmt.model_fingerprint(other) != fmt.model_fingerprint(config)


def test_model_fingerprint_refuses_values_without_a_stable_text() -> None:
    with pytest.raises(TypeError, match="hidden"):
        fmt.model_fingerprint({"hidden": object()})
