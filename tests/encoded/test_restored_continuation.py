"""Greedy decoding from an encoded snapshot restored into a transformers ``DynamicCache`` (the
built-in model in bf16, an English prompt): a lossless restore continues exactly as the plain
one; an fp8 restore continues from exactly the KV the file's e4m3 values and scales decode to
(decoded here from the file with safetensors, not by kvsnap), which is within the error the
file records and is not the bf16 KV (benchmarks/encoded_agreement.py measures the agreement
over 64 tokens)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsnap.encoded.read import read_encoded
from kvsnap.encoded.summary import reports_agree
from kvsnap.encoding import measure
from tests.support.prefill_kv import TEXT

pytest.importorskip("transformers")

from kvsnap.engines import transformers as kt  # after the skip: it needs transformers
from kvsnap.engines.default_model import load_model

PROMPT_TOKENS, NEW_TOKENS = 40, 16


@pytest.fixture(scope="module")
def restored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model, the prompt's ids, its prefilled cache, the three files and their restores."""
    model = load_model(dtype=torch.bfloat16)
    ids = model.encode(TEXT)[:PROMPT_TOKENS]
    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    work = tmp_path_factory.mktemp("continuation")
    result: dict[str, Any] = {"model": model, "ids": ids, "in-memory": cache, "work": work}
    for encoding in ("none", "lossless", "fp8"):
        path = work / f"{encoding}.safetensors"
        kt.capture_dynamic_cache(cache, [ids], path, model=model, compression=encoding)
        result[encoding], token_ids = kt.restore_dynamic_cache(path, model=model)
        assert token_ids == ids
    return result


def _states(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(keys.clone(), values.clone()) for keys, values in kt.dynamic_cache_states(cache)]


def _continue(model: Any, cache: Any, ids: list[int]) -> list[int]:
    return kt.continue_generation(model, copy.deepcopy(cache), ids, NEW_TOKENS)


def _first_logits(model: Any, cache: Any, ids: list[int]) -> torch.Tensor:
    """The logits that pick the first new token (the prompt's last token run again)."""
    cache = copy.deepcopy(cache)
    cache.crop(-1)
    return kt.forward_with_cache(model, [ids[-1]], cache)


def _decoded_from_file(path: Path, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``(1, heads, tokens, head_dim)`` bf16 as the format says
    an fp8 file decodes (docs/format.md, "Encoded snapshots"): ``e4m3(x) * scale`` in fp32,
    rounded to bf16; pages in the sequence's block order, read with safetensors alone."""
    from safetensors.torch import load_file

    stored = load_file(str(path))
    blocks = stored["sequences.0.block_ids"]
    layers = []
    for layer in range(sum(re.fullmatch(r"layers\.\d+\.key", name) is not None for name in stored)):
        parts = []
        for part in ("key", "value"):
            values = stored[f"layers.{layer}.{part}"]
            assert values.dtype == torch.float8_e4m3fn
            scales = stored[f"layers.{layer}.{part}.scales"]
            pages = (values.float() * scales[:, None, :, None]).to(torch.bfloat16)[blocks]
            tokens = pages.reshape(-1, *pages.shape[2:])[:num_tokens]
            parts.append(tokens.transpose(0, 1).unsqueeze(0))
        layers.append((parts[0], parts[1]))
    return layers


def _cache_of(model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    cache = kt.new_dynamic_cache(model)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.clone(), values.clone(), index)
    return cache


def test_a_lossless_restore_continues_exactly_as_the_plain_one(restored: dict) -> None:
    model, ids = restored["model"], restored["ids"]
    for (keys, values), (plain_keys, plain_values), (own_keys, own_values) in zip(
        _states(restored["lossless"]),
        _states(restored["none"]),
        _states(restored["in-memory"]),
        strict=True,
    ):
        assert torch.equal(keys, plain_keys) and torch.equal(values, plain_values)
        assert torch.equal(keys, own_keys) and torch.equal(values, own_values)
    plain = _continue(model, restored["none"], ids)
    assert _continue(model, restored["lossless"], ids) == plain
    assert plain == kt.generate_greedy(model, ids, NEW_TOKENS)  # as if never interrupted


def test_an_fp8_restore_continues_from_the_kv_its_file_decodes_to(restored: dict) -> None:
    model, ids, work = restored["model"], restored["ids"], restored["work"]
    decoded = _decoded_from_file(work / "fp8.safetensors", len(ids))
    for (keys, values), (want_keys, want_values) in zip(
        _states(restored["fp8"]), decoded, strict=True
    ):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    host = _cache_of(model, decoded)
    logits = _first_logits(model, restored["fp8"], ids)
    assert torch.equal(logits, _first_logits(model, host, ids))
    assert _continue(model, restored["fp8"], ids) == _continue(model, host, ids)
    # Not the bf16 KV: the first step's logits differ from the plain restore's.
    assert not torch.equal(logits, _first_logits(model, restored["none"], ids))


def test_an_fp8_restore_holds_the_error_its_file_records(restored: dict) -> None:
    """The error of the restored fp8 cache against the restored plain one, measured again as
    the encoder measures it, is the report the file carries."""
    recorded = read_encoded(restored["work"] / "fp8.safetensors").error
    assert recorded is not None
    pages = {}
    for label in ("none", "fp8"):
        pages[label] = {}
        for layer, (keys, values) in enumerate(_states(restored[label])):
            for part, states in (("key", keys), ("value", values)):
                # (1, heads, tokens, dim) -> (blocks, 16, heads, dim), the last block zero-padded
                tokens = states[0].transpose(0, 1)
                padded = tokens.new_zeros((48, *tokens.shape[1:]))
                padded[: len(tokens)] = tokens
                pages[label][f"layers.{layer}.{part}"] = padded.reshape(3, 16, *tokens.shape[1:])
    measured = measure.error_report(
        pages["none"],
        pages["fp8"],
        encoding=recorded.encoding,
        granularity=recorded.granularity,
        token_counts=torch.tensor([16, 16, PROMPT_TOKENS - 32]),
    )
    assert reports_agree(measured.to_dict(), recorded.to_dict())
    assert 0 < recorded.worst["rms_rel"] <= 0.03
