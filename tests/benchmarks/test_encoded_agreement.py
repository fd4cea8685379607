"""The encoded-agreement benchmark (``benchmarks/encoded_agreement.py``) run small, and the model
queries it measures fp8's attention error with (``benchmarks/model_queries.py``): attending
with them over the model's own cache gives the model's own attention output."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import encoded_agreement  # after the skip: it needs transformers
from benchmarks.model_queries import model_queries, per_kv_head
from kvsnap.encoding import measure
from kvsnap.engines import transformers as kt
from kvsnap.engines.default_model import load_model
from tests.support.prefill_kv import TEXT


def test_a_small_run_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    results = encoded_agreement.main(
        ["--prompts", "2", "--tokens", "48", "--new-tokens", "8", "--models", "built-in"]
    )
    model = results["models"]["built-in"]
    assert model["plain_equals_in_memory"] is True
    lossless, fp8 = model["lossless"], model["fp8"]
    assert lossless["kv_bit_exact"] is True
    assert lossless["agree"] == lossless["of"] == lossless["teacher_forced_agree"] == 16
    assert lossless["first_divergences"] == [None, None]
    assert 0 <= fp8["agree"] <= 16 and 0 <= fp8["teacher_forced_agree"] <= 16
    assert lossless["logit_rel_l2"] == lossless["kl"] == 0  # the same KV, the same logits
    assert 0 < fp8["logit_rel_l2"] < 0.1 and fp8["kl"] > 0
    assert fp8["ratio"] > lossless["ratio"] > 1
    for kind in ("recorded_keys", "prompt", "decode"):
        errors = fp8["attention_worst"][kind]
        assert len(errors) == 4 and all(0 < error < 0.1 for error in errors), (kind, errors)
    for kind in ("keys", "prompt", "decode"):
        weights = fp8["top_weight_mean"][kind]
        assert len(weights) == 4 and all(1 / 48 <= weight <= 1 for weight in weights)
    output = capsys.readouterr().out
    assert "built-in    lossless" in output and "bit-exact" in output and "0/2" in output
    assert "built-in    decode" in output


def test_model_queries_reproduce_the_models_attention_output() -> None:
    """Each layer's recorded queries, grouped onto their KV heads, attend over the cache the
    same prefill fills and give what the model's attention handed its output projection, for
    the last token (which attends to every token)."""
    model = load_model(dtype=torch.float32)
    ids = model.encode(TEXT)[:37]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _module, args, index=index: inputs.__setitem__(index, args[0])
        )
        for index, layer in enumerate(model.model.model.layers)
    ]
    try:
        [(cache, _)] = kt.prefill_token_ids(model, [ids])
    finally:
        for hook in hooks:
            hook.remove()
    queries = model_queries(model, ids)
    assert len(queries) == 4 and queries[0].shape == (37, 4, 32)
    for layer, (keys, values) in enumerate(kt.dynamic_cache_states(cache)):
        kv_heads = keys.shape[1]
        grouped = per_kv_head(queries[layer][-1:], kv_heads)  # (group, kv_heads, dim)
        ours = measure.attend(grouped, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        # ours[j, g] is query head j * group + g: the model's heads in order.
        model_output = inputs[layer][0, -1].reshape(-1, keys.shape[-1])
        torch.testing.assert_close(ours.reshape(-1, keys.shape[-1]), model_output)


def test_logits_after_a_cache_are_the_greedy_choices_fed_to_it() -> None:
    """What both agreement benchmarks teacher-force with: the logits after each fed token, the
    cache without the prompt's last token, pick the greedy continuation token by token."""
    model = load_model(dtype=torch.float32)
    ids = model.encode(TEXT)[:40]
    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    want = kt.continue_generation(model, copy.deepcopy(cache), ids, 8)
    fed = [ids[-1], *want[:-1]]
    assert encoded_agreement.teacher_forced(model, cache, fed).argmax(-1).tolist() == want
    cache.crop(-1)
    assert encoded_agreement.logits_after(model, cache, fed).argmax(-1).tolist() == want


def test_the_in_memory_fp8_agreement_of_the_encodings_benchmark_runs_small() -> None:
    """``benchmarks/encodings.py``'s greedy agreement (an fp8 round trip in memory), which
    compares tokens and logits with this benchmark's functions."""
    from benchmarks import encodings

    model = load_model(dtype=torch.bfloat16)
    ids = model.encode(TEXT)
    figures = encodings.greedy_agreement(model.model, [ids[:48], ids[60:108]], new_tokens=8)
    assert (figures["prompts"], figures["tokens"]) == (2, 8)
    for granularity in ("block-head", "tensor"):
        item = figures[granularity]
        assert 0 <= item["free_running_agree"] <= 1 and 0 <= item["teacher_forced_agree"] <= 1
        assert 0 <= item["mean_first_difference"] <= 8
    assert figures["median_logit_margin"] >= 0
