"""``verify --against`` (``Snapshot.compare``) across dtypes and block sizes: values compared
token by token in a dtype that holds both, the dtypes named; only a different shape (layers,
KV heads, head size) is refused, saying what may and may not differ."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.snapshot import Snapshot
from kvsnap.testing.golden import KVData, kv_data, write_kv_snapshot

runner = CliRunner()


def verify_json(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def converted(data: KVData, dtype: torch.dtype) -> KVData:
    """``data`` with every tensor cast to ``dtype`` (rounded to nearest, as engines do)."""
    sequences = [
        dataclasses.replace(
            sequence, tensors={name: t.to(dtype) for name, t in sequence.tensors.items()}
        )
        for sequence in data.sequences
    ]
    return dataclasses.replace(data, sequences=sequences)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One synthetic KV written as float32 with 16-token blocks, as float32 with 32-token
    blocks, as bfloat16 with 32-token blocks, and a 3-layer snapshot."""
    root = tmp_path_factory.mktemp("compare-across")
    paths = {name: str(root / f"{name}.safetensors") for name in ("f32", "f32-b32", "bf16-b32")}
    result = runner.invoke(
        app, ["fixture", paths["f32"], "--dtype", "float32", "--lengths", "37,70", "--seed", "5"]
    )
    assert result.exit_code == 0, result.stderr
    data = kv_data(paths["f32"])
    write_kv_snapshot(data, paths["f32-b32"], block_size=32)
    write_kv_snapshot(converted(data, torch.bfloat16), paths["bf16-b32"], block_size=32)
    paths["3-layers"] = str(root / "3-layers.safetensors")
    result = runner.invoke(app, ["fixture", paths["3-layers"], "--layers", "3", "--lengths", "37"])
    assert result.exit_code == 0, result.stderr
    return paths


def test_another_block_size_compares_token_by_token(snapshots: dict[str, str]) -> None:
    code, payload = verify_json(snapshots["f32"], "--against", snapshots["f32-b32"])
    assert code == 0 and payload["ok"], payload
    assert payload["notes"] == ["values of the two block sizes compared token by token"]
    stated = {
        (source["field"], source["a"], source["b"]) for source in payload["comparison"]["sources"]
    }
    assert ("block size", "16", "32") in stated


def test_another_dtype_compares_in_the_wider_one_within_a_tolerance(
    snapshots: dict[str, str],
) -> None:
    # bfloat16 keeps 8 significant bits: a relative rounding error of at most 2**-8.
    code, payload = verify_json(
        snapshots["f32"], "--against", snapshots["bf16-b32"], "--rtol", str(2**-8)
    )
    assert code == 0 and payload["ok"], payload
    assert (
        payload["notes"][0]
        == "values of the two dtypes compared in float32, within atol 0, rtol 0.00390625"
    )
    stated = {
        (source["field"], source["a"], source["b"]) for source in payload["comparison"]["sources"]
    }
    assert ("dtype", "float32", "bfloat16") in stated  # the difference itself, stated once

    # Without a tolerance the rounding shows, element by element, and the note says why.
    code, payload = verify_json(snapshots["f32"], "--against", snapshots["bf16-b32"])
    assert code == 1 and not payload["ok"]
    assert {problem["tensor"] for problem in payload["problems"]} == {
        "layers.0.key",
        "layers.0.value",
        "layers.1.key",
        "layers.1.value",
    }
    assert "give a tolerance" in payload["notes"][0]
    # The largest difference is a bfloat16 rounding of the float32 values, no more.
    with Snapshot.open(snapshots["f32"]) as exact, Snapshot.open(snapshots["bf16-b32"]) as rounded:
        comparison = exact.compare(rounded, rtol=2**-8)
        assert comparison.ok
        largest = max(
            float(exact.read_tensor(name).abs().max()) for name in exact.geometry.tensor_names()
        )
        assert 0 < max(layer.max_abs_diff for layer in comparison.layers) <= largest * 2**-8


def test_another_shape_is_refused_saying_what_may_differ(snapshots: dict[str, str]) -> None:
    code, payload = verify_json(snapshots["f32"], "--against", snapshots["3-layers"])
    assert code == 1
    [problem] = payload["problems"]
    assert "num_layers: 2 vs 3" in problem["message"]
    assert "the dtype and the block size may differ" in problem["message"]
