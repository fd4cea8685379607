"""Real vLLM's dumps and stored chunks read by other tools: the kvsnap CLI inspects and verifies
them (and names a corrupted block), and a vLLM dump agrees with transformers' capture of the same
model within bf16 rounding. The engines are the restart scenario's (``test_restarts.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsnap.engines.vllm import chunk_sequence_id
from kvsnap.snapshot import Snapshot
from tests.support.vllm_engines import PYTHON, ROOT, EngineRun
from tests.support.vllm_scenario import BLOCK, Scenario, _dump, _keys

pytestmark = pytest.mark.vllm


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    # This tree's CLI and library, as the engines use them (not whatever the venv installed).
    result = subprocess.run(
        [str(PYTHON), "-m", "kvsnap.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return result.returncode, json.loads(result.stdout)


def test_dumps_and_chunks_are_read_by_the_kvsnap_cli(scenario: Scenario) -> None:
    dump = _dump(scenario.runs["e1"], "A")
    code, info = _cli("inspect", str(dump))
    assert code == 0
    assert (
        info["model"]["engine"] == "vllm"
        and info["layout"]["capture_encoding"] == "vllm-cpu-attn-lbhnc"
    )
    assert info["layout"]["num_kv_heads"] == 2 and info["layout"]["block_size"] == BLOCK
    assert [(s["num_tokens"], s["num_blocks"]) for s in info["sequences"]] == [(100, 4)]
    code, report = _cli("verify", str(dump))
    assert (code, report) == (0, {"ok": True, "problems": []})
    # A stored chunk is an ordinary snapshot too: one sequence, named by where it starts.
    code, info = _cli("inspect", str(scenario.kept["A"][1]))
    a_keys = _keys(scenario.prompts["A"][: 3 * BLOCK])  # A's 3 loadable blocks
    assert code == 0
    assert [(s["id"], s["num_tokens"]) for s in info["sequences"]] == [
        (chunk_sequence_id(2, a_keys[1], a_keys[2]), 32)
    ]
    # The same CLI names the corrupted persisted block.
    code, report = _cli("verify", str(scenario.corrupt_copy))
    assert code != 0 and not report["ok"]
    tensor, block = scenario.corrupted
    assert any(p["tensor"] == tensor and p["block"] == block for p in report["problems"]), report


def _transformers_capture(model_dir: Path, tokens: list[int], path: Path, perturb: bool) -> None:
    """Prefill ``tokens`` with transformers (bf16, eager) and capture the DynamicCache."""
    from kvsnap.engines import transformers as hf
    from kvsnap.engines.default_model import load_model

    loaded = load_model(str(model_dir), dtype=torch.bfloat16)
    if perturb:
        with torch.no_grad():  # layer 1's keys change; its values and all of layer 0 do not
            loaded.model.model.layers[1].self_attn.k_proj.weight.mul_(1.25)
    cache = hf.new_dynamic_cache(loaded)
    hf.forward_with_cache(loaded, tokens, cache)
    hf.capture_dynamic_cache(
        cache, [tokens], path, model=loaded, block_size=BLOCK, sequence_ids=["0"]
    )


def test_vllm_dump_agrees_with_transformers_and_names_a_perturbed_layer(
    scenario: Scenario, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    dump = _dump(scenario.runs["e1"], "A")
    reference, perturbed = tmp_path / "hf.safetensors", tmp_path / "hf-perturbed.safetensors"
    _transformers_capture(scenario.model, scenario.prompts["A"], reference, perturb=False)
    _transformers_capture(scenario.model, scenario.prompts["A"], perturbed, perturb=True)
    with Snapshot.open(dump) as vllm_snap, Snapshot.open(reference) as hf_snap:
        # Same model, seen by two engines: one fingerprint.
        assert (
            vllm_snap.metadata.source.model_fingerprint == hf_snap.metadata.source.model_fingerprint
        )
    # Two bf16 engines with different kernels agree within a few bf16 steps (|KV| < 16).
    tolerance = ["--atol", "0.25"]
    code, report = _cli("verify", str(dump), "--against", str(reference), *tolerance)
    assert code == 0 and report["ok"] and report["problems"] == [], report
    assert report["comparison"]["first_divergent_layer"] is None
    code, report = _cli("verify", str(dump), "--against", str(perturbed), *tolerance)
    assert code != 0 and not report["ok"]
    assert {problem["tensor"] for problem in report["problems"]} == {"layers.1.key"}, report
    (problem,) = report["problems"]
    assert problem["first_mismatch"]["sequence"] == "0" and problem["max_abs_diff"] > 1


#: The documented bf16 tolerance of a vLLM dump against transformers (docs/vllm.md, "Comparing
#: with another engine"): two engines with different kernels agree within a few bf16 steps.
BF16_ATOL = "0.25"


def test_kvsnap_diff_across_engines_locates_a_perturbed_vllm_run(
    scenario: Scenario, perturbed_run: EngineRun, tmp_path: Path
) -> None:
    """The debugging workflow: vLLM's dump against transformers' capture of the same prompt on
    the same model agrees within bf16 tolerance, located and measured by ``kvsnap diff``; a
    vLLM run whose layer 1 keys were changed (``perturbed_run``: the scenario's prompt A on
    ``vllm_scenario.perturbed_model``) is located to that layer, its fingerprint named."""
    pytest.importorskip("transformers")
    dump = _dump(scenario.runs["e1"], "A")
    reference = tmp_path / "hf.safetensors"
    _transformers_capture(scenario.model, scenario.prompts["A"], reference, perturb=False)
    code, report = _cli("diff", str(dump), str(reference), "--atol", BF16_ATOL)
    assert code == 0 and report["ok"], report
    # Same model, other engine: said up front, and not a failure.
    assert {difference["field"] for difference in report["sources"]} == {"engine"}
    for layer in report["layers"]:
        assert layer["num_mismatches"] == 0 and layer["num_elements"] == 100 * 2 * 32
        assert layer["cosine_min"] > 0.999 and layer["rel_error_max"] < 0.05, layer
    assert report["first_divergent_layer"] is None and len(report["top"]) == 10

    perturbed = _dump(perturbed_run, "A")
    code, report = _cli("diff", str(perturbed), str(reference), "--atol", BF16_ATOL)
    assert code == 1 and not report["ok"]
    assert report["first_divergent_layer"] == 1
    assert "model fingerprint" in {difference["field"] for difference in report["sources"]}
    layers = {layer["tensor"]: layer for layer in report["layers"]}
    beyond = {name for name, layer in layers.items() if layer["num_mismatches"]}
    assert beyond == {"layers.1.key"}, beyond
    assert layers["layers.1.key"]["max_abs_diff"] > 1 and layers["layers.1.key"]["share"] > 0.1
    assert layers["layers.1.key"]["cosine_min"] < layers["layers.1.value"]["cosine_min"]
    assert all(entry["tensor"] == "layers.1.key" for entry in report["top"])
