"""``kvsnap diff A B`` (and ``verify --against``, which shares its report) as a debugging
engineer uses it: one weight of one layer changed, the same prompt captured from both models,
and the report names the layer, the head and the channels, gives the share and the cosine,
and flags the fingerprint difference; on the built-in model and on a Qwen2 built from a
config. Also: the JSON carries every number, each difference (a dtype's too) is stated once,
the text fits 100 columns, and the picture of 8,000 tokens is binned with NaN marked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.snapshot import Snapshot
from kvsnap.testing.golden import KVData, KVSequenceData, write_kv_snapshot

runner = CliRunner()
PROMPT = "kvsnap keeps the KV cache of this prompt, bit for bit, across restarts."
#: The weight changed: layer 1's k_proj, output row 0 (head 0, dimension 0), input column 5.
ROW, COLUMN, DELTA = 0, 5, 1e-3


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(config).eval()


def _builtin() -> torch.nn.Module:
    from kvsnap.engines.default_model import build_default_model

    return build_default_model()


@pytest.fixture(scope="module", params=["built-in", "qwen2"])
def one_weight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same prompt captured from a model and from a copy with one weight of layer 1's
    k_proj changed by 1e-3 (RoPE pairs the changed dimension 0 with 16 of head 0)."""
    directory = tmp_path_factory.mktemp(f"one-weight-{request.param}")
    model = _builtin() if request.param == "built-in" else _qwen2()
    model.save_pretrained(directory / "base")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[ROW, COLUMN] += DELTA
    model.save_pretrained(directory / "changed")
    paths = {}
    for name in ("base", "changed"):
        paths[name] = directory / f"{name}.safetensors"
        code, _, err = run(
            "capture", "-o", str(paths[name]), "-m", str(directory / name), "-p", PROMPT
        )
        assert code == 0, err
    return paths


def test_one_changed_weight_is_named_by_layer_head_and_channels(one_weight: dict) -> None:
    code, out, err = run("diff", str(one_weight["changed"]), str(one_weight["base"]), "--json")
    assert code == 1, err
    report = json.loads(out)
    # Where it comes from: the fingerprint differs, said up front.
    fields = {difference["field"] for difference in report["sources"]}
    assert "model fingerprint" in fields
    # The first layer that differs is 1, its keys only; the earlier layer is identical.
    assert report["first_divergent_layer"] == 1
    layers = {layer["tensor"]: layer for layer in report["layers"]}
    assert (
        layers["layers.0.key"]["max_abs_diff"] == 0
        and layers["layers.0.value"]["num_mismatches"] == 0
    )
    assert layers["layers.1.value"]["max_abs_diff"] == 0
    key = layers["layers.1.key"]
    # Head 0 carries it, in channels 0 and 16; head 1 is untouched.
    heads = {head["head"]: head for head in key["heads"]}
    assert {channel for channel, _ in heads[0]["top_channels"]} == {0, 16}
    assert heads[1]["max_abs_diff"] == 0 and heads[1]["num_mismatches"] == 0
    # The share beyond the tolerance: 2 channels of 64 per token (token 0 is unrotated: 1).
    tokens = key["num_elements"] // 64
    assert key["num_mismatches"] in (2 * tokens - 1, 2 * tokens)
    assert key["share"] == pytest.approx(key["num_mismatches"] / key["num_elements"])
    assert 0.99 < key["cosine_min"] < 1 and 0 < key["rel_error_max"] < 0.01
    # The largest differences are all there.
    assert report["top"] and all(
        (entry["tensor"], entry["head"], entry["channel"] in (0, 16)) == ("layers.1.key", 0, True)
        for entry in report["top"]
    )
    assert {entry["channel"] for entry in report["top"]} == {0, 16}


def test_the_text_report_says_it_in_100_columns(one_weight: dict) -> None:
    code, out, _ = run("diff", str(one_weight["changed"]), str(one_weight["base"]), "--top", "4")
    assert code == 1
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines if "safetensors" not in line), out
    flat = " ".join(out.split())
    assert re.search(r"differs: model fingerprint: [0-9a-f]{16} \(A\) vs [0-9a-f]{16} \(B\)", flat)
    assert re.search(r"layers\.1\.key +[\d.e-]+ +seq-0 t\d+ h0 c(0|16) +\d+ \([\d.]+%\)", out)
    assert "first difference beyond the tolerance: layer 1 (layers.1.key)" in flat
    heads_table = out[out.index("heads of layers.1.key:") :]
    assert re.search(
        r"\n +0 +[\d.e-]+ +\d+ \([\d.]+%\) +[\d.e-]+ +1-[\d.e-]+ +(0|16) \(", heads_table
    )
    top = out[out.index("largest differences (4):") :].splitlines()[2:6]
    assert all(re.match(r" +\d+  layers\.1\.key +seq-0 +\d+ +0 +(0|16) ", row) for row in top), top
    assert "DIFFERENT:" in out


def test_verify_against_shares_the_report_and_states_each_difference_once(
    one_weight: dict,
) -> None:
    code, out, _ = run("verify", str(one_weight["changed"]), "--against", str(one_weight["base"]))
    assert code == 1
    assert "heads of layers.1.key:" in out and "largest differences" in out
    # Each differing tensor is in the table, and not again as a "problem:" line.
    assert "problem:" not in out
    assert out.count("layers.1.key ") == 1 + out[out.index("largest") :].count("layers.1.key ")


def test_a_dtype_difference_is_stated_once(tmp_path: Path) -> None:
    # The built-in model's KV of one prompt captured in float32 (A) and in bfloat16 (B).
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path, dtype in zip(paths, ("float32", "bfloat16"), strict=True):
        code, _, err = run("capture", "-o", str(path), "--dtype", dtype, "-p", PROMPT)
        assert code == 0, err
    for command in (("diff", str(paths[0])), ("verify", str(paths[0]), "--against")):
        code, out, _ = run(*command, str(paths[1]), "--rtol", "0.01")
        header = " ".join(out[out.index("A: ") : out.index("tolerance:")].split())
        assert code == 1 and header.count("bfloat16") == 1, out
        assert "differs: dtype: float32 (A) vs bfloat16 (B)" in header
        assert (
            "note: values of the two dtypes compared in float32, within atol 0, rtol 0.01" in header
        )


def test_json_carries_the_numbers_the_text_shows_within_a_tolerance(one_weight: dict) -> None:
    """With --atol 1 nothing is beyond the tolerance, and the JSON still has every number."""
    changed, base = str(one_weight["changed"]), str(one_weight["base"])
    code, out, _ = run("verify", changed, "--against", base, "--atol", "1", "--json")
    payload = json.loads(out)
    assert code == 0 and payload["ok"] and payload["problems"] == []
    layers = payload["comparison"]["layers"]
    key = next(layer for layer in layers if layer["tensor"] == "layers.1.key")
    code, text_out, _ = run("verify", changed, "--against", base, "--atol", "1")
    assert code == 0
    row = next(line for line in text_out.splitlines() if line.startswith("layers.1.key"))
    assert f"{key['max_abs_diff']:.3g}" in row and key["max_abs_diff"] > 0
    assert key["num_mismatches"] == 0 and key["cosine_min"] < 1
    code, out, _ = run("diff", changed, base, "--atol", "1", "--json")
    assert code == 0 and json.loads(out)["layers"] == payload["comparison"]["layers"]


def test_a_picture_of_8000_tokens_is_binned_and_marks_nan(tmp_path: Path) -> None:
    tokens = 8000
    generator = torch.Generator().manual_seed(1)
    names = ["layers.0.key", "layers.0.value", "layers.1.key", "layers.1.value"]
    a = {name: torch.randn(tokens, 2, 8, generator=generator) for name in names}
    b = {
        name: value + 1e-3 * torch.randn(value.shape, generator=generator)
        for name, value in a.items()
    }
    b["layers.1.value"][5000, 1, 2] = float("nan")
    paths = []
    for name, tensors in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.safetensors")
        data = KVData([KVSequenceData("long", np.arange(tokens), tensors)], names)
        write_kv_snapshot(data, paths[-1], block_size=16)
    picture = tmp_path / "diff.png"
    code, out, err = run("diff", str(paths[0]), str(paths[1]), "--plot", str(picture))
    assert code == 1, err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000
    assert f"plot written to {picture}" in " ".join(out.split())
    # The NaN is pointed out in the token panels (the left three quarters) wider than its
    # column, which at 8,000 tokens is under a pixel and may not be drawn at all.
    import matplotlib.image

    pixels = matplotlib.image.imread(picture)[..., :3]
    magenta = np.abs(pixels - np.array([1.0, 0.0, 1.0])).sum(axis=-1) < 0.15
    columns = np.nonzero(magenta[:, : pixels.shape[1] * 3 // 4].any(axis=0))[0]
    assert columns.size and columns.max() - columns.min() >= 5, columns
    with Snapshot.open(paths[0]) as first, Snapshot.open(paths[1]) as second:
        assert first.compare(second).profile is None  # kept only when asked for
        profile = first.compare(second, profile=True).profile
    assert profile is not None and profile.num_tokens == tokens
    values = profile.values["value"]
    assert values.shape == (2, 1024, 2)  # 2 layers, 1024 bins of about 8 tokens, 2 heads
    bin_of_nan = int(np.searchsorted(profile.bin_starts, 5000, side="right")) - 1
    assert np.isnan(values[1, bin_of_nan, 1]) and np.isnan(values).sum() == 1
    assert (profile.values["key"] > 0).all()


def test_a_damaged_block_stops_the_diff_with_one_line(one_weight: dict, tmp_path: Path) -> None:
    """Both snapshots are checked block by block as they are read: a flipped byte is named, in
    one line, whichever thread reads it, and nothing is reported as compared."""
    data = bytearray(one_weight["base"].read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    code, out, err = run("diff", str(one_weight["changed"]), str(damaged))
    assert code == 1 and out == ""
    [line] = err.strip().splitlines()
    assert re.search(r"tensor layers\.\d+\.(key|value), block \d+: xxh3-64", line), line
