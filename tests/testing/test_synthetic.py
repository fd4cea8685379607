"""The synthetic KV generator: what its values model, that files are reproducible, that every
layout captures to the same canonical data, and the ``kvsnap fixture`` command."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.snapshot import Snapshot
from kvsnap.testing.synthetic import (
    LAYOUTS,
    OUTLIER_MAGNITUDE,
    ROPE_BASE,
    VALUE_STD,
    apply_rope,
    build_cache,
    generate,
    make_spec,
    synthesize,
)

SMALL = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_dim": 16}
CAPTURE_ENCODING = {
    "vllm-split-nhd": "vllm-split-nhd",
    "vllm-split-hnd": "vllm-split-hnd",
    "packed": "packed",
    "legacy": "vllm-legacy",
    "flat-paged": "flat-paged",
    "cross-layer": "cross-layer",
    "mla": "mla",
}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so comparisons are bit-exact (NaN-safe, -0.0 != 0.0)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _layer_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as file:
        return {name: file.get_tensor(name) for name in file.keys() if name.startswith("layers.")}


# --------------------------------------------------------------------------------------------
# The value model


def _complex_rope_reference(x: np.ndarray, positions: np.ndarray, interleaved: bool) -> np.ndarray:
    """RoPE written as complex multiplication, independent of apply_rope's real arithmetic."""
    dim = x.shape[-1]
    theta = ROPE_BASE ** (-np.arange(0, dim, 2) / dim)
    turn = np.exp(1j * positions[:, None] * theta[None, :])[:, None, :]  # (tokens, 1, dim/2)
    if interleaved:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    half = dim // 2
    z = (x[..., :half] + 1j * x[..., half:]) * turn
    return np.concatenate((z.real, z.imag), axis=-1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_is_the_standard_rotary_embedding(interleaved: bool) -> None:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn((37, 3, 12), generator=generator, dtype=torch.float64)
    positions = torch.randint(0, 5000, (37,), generator=generator)
    rotated = apply_rope(x, positions, interleaved=interleaved)
    expected = _complex_rope_reference(x.numpy(), positions.numpy().astype(np.float64), interleaved)
    np.testing.assert_allclose(rotated.numpy(), expected, rtol=0, atol=1e-12)
    # Relative-position property: <rope(q, m), rope(k, n)> depends only on m - n.
    q, k = x[:1], x[1:2]
    m, n, shift = torch.tensor([900]), torch.tensor([850]), torch.tensor([1234])
    near = (
        apply_rope(q, m, interleaved=interleaved) * apply_rope(k, n, interleaved=interleaved)
    ).sum(-1)
    far = (
        apply_rope(q, m + shift, interleaved=interleaved)
        * apply_rope(k, n + shift, interleaved=interleaved)
    ).sum(-1)
    torch.testing.assert_close(near, far, rtol=0, atol=1e-10)


def test_keys_are_rope_rotated_with_outlier_channel_pairs_and_values_are_n_0_half() -> None:
    spec = make_spec(
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype="float64",
        sequence_lengths=[4096],
        seed=11,
    )
    (sequence,) = synthesize(spec)
    keys = sequence.kv["layers.0.key"]  # (tokens, heads, dim)
    positions = torch.arange(4096)
    # Undo the rotation at each token's absolute position: the channel statistics become
    # stationary; in the raw keys the low-frequency outlier pairs visibly turn over 4096 tokens.
    unrotated = apply_rope(keys, -positions)
    early, late = slice(0, 512), slice(3584, 4096)
    half = 32
    low_frequency = set(range(half - half // 4, half)) | set(range(2 * half - half // 4, 2 * half))
    for head in range(2):
        channel_mean = unrotated[:, head].mean(0)
        outliers = torch.nonzero(channel_mean.abs() > OUTLIER_MAGNITUDE[0] * 0.8).flatten().tolist()
        # pairs // 16 = 2 outlier pairs per head, each pair (i, i + dim/2), all low-frequency.
        assert len(outliers) == 4, outliers
        assert set(outliers) <= low_frequency
        assert {channel % half for channel in outliers} == {
            channel for channel in outliers if channel < half
        }
        ordinary = [c for c in range(64) if c not in outliers]
        assert channel_mean[ordinary].abs().max() < 0.6
        for channel in outliers:
            stationary = (
                unrotated[early, head, channel].mean() - unrotated[late, head, channel].mean()
            )
            turned = keys[early, head, channel].mean() - keys[late, head, channel].mean()
            assert abs(float(stationary)) < 0.6
            assert abs(float(turned)) > 1.0
    values = sequence.kv["layers.0.value"]
    assert abs(float(values.mean())) < 0.01
    assert abs(float(values.std()) - VALUE_STD) < 0.01


def test_mla_latent_has_compressed_part_and_interleaved_rope_tail() -> None:
    spec = make_spec(
        num_layers=1,
        block_size=16,
        dtype="float64",
        sequence_lengths=[4096],
        attention="mla",
        latent_dim=576,
        seed=3,
    )
    assert spec.rope_dim == 64
    (sequence,) = synthesize(spec)
    latent = sequence.kv["layers.0.latent"]
    assert latent.shape == (4096, 576)
    compressed, rope = latent[:, :512], latent[:, 512:]
    # The compressed part is not rotated: its statistics are stationary as they are.
    compressed_outliers = torch.nonzero(compressed.mean(0).abs() > 4).flatten()
    assert len(compressed_outliers) == 512 // 64
    drift = compressed[:512].mean(0) - compressed[-512:].mean(0)
    assert drift.abs().max() < 0.6
    # The rotary tail is stationary only after undoing interleaved RoPE.
    unrotated = apply_rope(rope.unsqueeze(1), -torch.arange(4096), interleaved=True).squeeze(1)
    outlier_pair = torch.nonzero(unrotated.mean(0).abs() > 4).flatten().tolist()
    assert len(outlier_pair) == 2 and outlier_pair[1] == outlier_pair[0] + 1
    assert outlier_pair[0] % 2 == 0 and outlier_pair[0] >= 64 - 2 * (32 // 4)
    channel = outlier_pair[0]
    assert abs(float(unrotated[:512, channel].mean() - unrotated[-512:, channel].mean())) < 0.6
    assert abs(float(rope[:512, channel].mean() - rope[-512:, channel].mean())) > 1.0


def test_shared_prefix_has_identical_tokens_kv_and_physical_blocks() -> None:
    spec = make_spec(
        **SMALL, dtype="bfloat16", sequence_lengths=[13, 10, 9], shared_prefix_tokens=9
    )
    first, *others = synthesize(spec)
    for other in others:
        assert np.array_equal(first.token_ids[:9], other.token_ids[:9])
        assert not np.array_equal(first.token_ids[9:], other.token_ids[9 : len(first.token_ids)])
        # 9 shared tokens = 2 full blocks of 4: the same physical blocks; the partial one is own.
        assert np.array_equal(first.block_ids[:2], other.block_ids[:2])
        assert first.block_ids[2] != other.block_ids[2]
        for name, values in first.kv.items():
            assert torch.equal(_bits(values[:9]), _bits(other.kv[name][:9]))
            assert not torch.equal(values[9:10], other.kv[name][9:10])


def test_values_depend_on_the_seed_and_only_on_the_seed(tmp_path: Path) -> None:
    arguments = {**SMALL, "dtype": "bfloat16", "sequence_lengths": [7, 5]}
    again = synthesize(make_spec(**arguments, seed=4))
    for a, b in zip(synthesize(make_spec(**arguments, seed=4)), again, strict=True):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert all(torch.equal(_bits(a.kv[name]), _bits(b.kv[name])) for name in a.kv)
    other = synthesize(make_spec(**arguments, seed=5))
    assert not torch.equal(again[0].kv["layers.0.value"], other[0].kv["layers.0.value"])
    assert not np.array_equal(again[0].token_ids, other[0].token_ids)


# --------------------------------------------------------------------------------------------
# Caches and snapshots


def test_cache_holds_each_token_in_its_block_zero_tails_and_nan_spares() -> None:
    spec = make_spec(**SMALL, dtype="float32", sequence_lengths=[10, 7], layout="packed")
    cache = build_cache(spec)
    sequences = synthesize(spec)
    used = np.concatenate([sequence.block_ids for sequence in sequences])
    spare = sorted(set(range(cache.layout.num_blocks)) - set(used.tolist()))
    assert spare, "the generator keeps spare blocks"
    for name, view in cache.page_views.items():
        assert torch.isnan(view[spare]).all()
        for sequence in sequences:
            pages = view[torch.from_numpy(sequence.block_ids)].reshape(-1, *view.shape[2:])
            count = len(sequence.token_ids)
            assert torch.equal(pages[:count], sequence.kv[name])
            assert (pages[count:] == 0).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_every_layout_captures_the_same_canonical_tensors(tmp_path: Path, dtype: str) -> None:
    arguments = {**SMALL, "dtype": dtype, "sequence_lengths": [10, 7], "shared_prefix_tokens": 5}
    sequences = synthesize(make_spec(**arguments))
    reference: dict[str, torch.Tensor] | None = None
    for layout in LAYOUTS:
        if layout == "mla":
            continue
        path = tmp_path / f"{layout}.safetensors"
        result = generate(path, layout=layout, **arguments)
        assert (result.num_sequences, result.num_tokens) == (2, 17)
        # 5 shared tokens: block 0 (tokens 0..3) is stored once, so 3 + 2 - 1 blocks.
        assert result.num_blocks == 4
        tensors = _layer_tensors(path)
        if reference is None:
            reference = tensors
        assert tensors.keys() == reference.keys()
        for name in tensors:
            assert torch.equal(_bits(tensors[name]), _bits(reference[name])), (layout, name)
        with Snapshot.open(path) as snapshot:
            assert snapshot.verify() == []
            assert snapshot.metadata.capture_encoding == CAPTURE_ENCODING[layout]
            assert snapshot.metadata.created is None
            for expected, record in zip(sequences, snapshot.sequences, strict=True):
                assert np.array_equal(record.token_ids, expected.token_ids)
                for name, values in expected.kv.items():
                    assert torch.equal(_bits(snapshot.sequence_kv(record.id, name)), _bits(values))
            assert not any(
                snapshot.tensor_stats(name)["nan"] for name in snapshot.geometry.tensor_names()
            )


def test_mla_snapshot_holds_the_latents(tmp_path: Path) -> None:
    arguments = {
        "num_layers": 3,
        "block_size": 4,
        "dtype": "bfloat16",
        "sequence_lengths": [6, 9],
        "attention": "mla",
        "latent_dim": 40,
    }
    sequences = synthesize(make_spec(**arguments))
    path = tmp_path / "mla.safetensors"
    generate(path, **arguments)
    with Snapshot.open(path) as snapshot:
        assert snapshot.verify() == []
        assert snapshot.geometry.latent_dim == 40
        assert snapshot.geometry.attention_types == ("mla",) * 3
        for expected in sequences:
            for name, values in expected.kv.items():
                assert torch.equal(_bits(snapshot.sequence_kv(expected.id, name)), _bits(values))


def test_sliding_attention_is_recorded_per_layer(tmp_path: Path) -> None:
    path = tmp_path / "sliding.safetensors"
    generate(
        path,
        **{**SMALL, "num_layers": 4},
        dtype="float16",
        sequence_lengths=[5],
        attention="sliding",
    )
    with Snapshot.open(path) as snapshot:
        assert snapshot.geometry.attention_types == ("sliding", "full", "sliding", "full")


def test_snapshot_restores_into_a_cache_of_another_layout(tmp_path: Path) -> None:
    arguments = {
        **SMALL,
        "dtype": "bfloat16",
        "sequence_lengths": [10, 7],
        "shared_prefix_tokens": 4,
    }
    path = tmp_path / "nhd.safetensors"
    generate(path, layout="vllm-split-nhd", **arguments)
    target_spec = make_spec(layout="cross-layer", **arguments)
    expected = build_cache(target_spec)  # same values, the cross-layer cache's own block ids
    target = build_cache(target_spec)
    for view in target.page_views.values():
        view.zero_()
    with Snapshot.open(path) as snapshot:
        snapshot.restore(
            target.layout,
            {sequence.id: sequence.block_ids for sequence in target.sequences},
            model_fingerprint=snapshot.metadata.source.model_fingerprint,
        )
    for name, view in target.page_views.items():
        for sequence in expected.sequences:
            blocks = torch.from_numpy(sequence.block_ids)
            assert torch.equal(_bits(view[blocks]), _bits(expected.page_views[name][blocks]))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({**SMALL, "attention": "mla"}, "latent_dim"),
        (
            {
                "num_layers": 2,
                "block_size": 4,
                "attention": "mla",
                "latent_dim": 16,
                "layout": "packed",
            },
            "MLA",
        ),
        ({**SMALL, "latent_dim": 16}, "latent_dim is for attention 'mla'"),
        ({**SMALL, "head_dim": 15}, "even head_dim"),
        ({**SMALL, "layout": "paged"}, "layout must be one of"),
        ({**SMALL, "attention": "local"}, "attention must be one of"),
        ({**SMALL, "shared_prefix_tokens": 8}, "shared_prefix_tokens 8"),
        ({**SMALL, "dtype": "int8"}, "floating-point dtype"),
    ],
)
def test_invalid_arguments_are_refused(tmp_path: Path, arguments: dict, message: str) -> None:
    arguments = {"dtype": "bfloat16", "sequence_lengths": [7, 5], **arguments}
    with pytest.raises(ValueError, match=message):
        generate(tmp_path / "x.safetensors", **arguments)
    assert not (tmp_path / "x.safetensors").exists()


# --------------------------------------------------------------------------------------------
# Reproducibility and the CLI


def test_generate_is_byte_identical_and_records_nothing_time_or_host_dependent(
    tmp_path: Path,
) -> None:
    arguments = {**SMALL, "dtype": "bfloat16", "sequence_lengths": [9, 6], "seed": 3}
    first, second = tmp_path / "a" / "one.safetensors", tmp_path / "b" / "two.safetensors"
    first.parent.mkdir()
    second.parent.mkdir()
    generate(first, **arguments)
    generate(second, **arguments)
    assert first.read_bytes() == second.read_bytes()
    with safe_open(str(first), "pt") as file:
        metadata = json.loads(file.metadata()["kvsnap"])
    assert metadata["created"] is None
    text = json.dumps(metadata)
    assert str(tmp_path) not in text and "one.safetensors" not in text
    assert metadata["source"]["engine"] == "kvsnap-synthetic"


def _cli_fixture(path: Path, seed: int) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "kvsnap.cli",
        "fixture",
        str(path),
        "--layers",
        "2",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--block-size",
        "4",
        "--lengths",
        "9,6",
        "--shared-prefix",
        "4",
        "--seed",
        str(seed),
        "--json",
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_fixture_runs_in_separate_processes_give_identical_bytes(tmp_path: Path) -> None:
    paths = [tmp_path / "first.safetensors", tmp_path / "second.safetensors"]
    processes = [_cli_fixture(path, seed=0) for path in paths]
    payloads = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        payloads.append(json.loads(out))
    contents = [path.read_bytes() for path in paths]
    assert contents[0] == contents[1]
    for path, payload, content in zip(paths, payloads, contents, strict=True):
        assert payload["path"] == str(path)
        assert payload["sha256"] == hashlib.sha256(content).hexdigest()
        assert payload["bytes"] == len(content)
        assert (payload["sequences"], payload["tokens"]) == (2, 15)
    # The CLI writes exactly what the library writes for the same arguments (a third process,
    # this one), and another seed changes the bytes.
    arguments = {
        **SMALL,
        "dtype": "bfloat16",
        "sequence_lengths": [9, 6],
        "shared_prefix_tokens": 4,
    }
    library, other_seed = tmp_path / "library.safetensors", tmp_path / "seed1.safetensors"
    generate(library, **arguments, seed=0)
    generate(other_seed, **arguments, seed=1)
    assert library.read_bytes() == contents[0]
    assert other_seed.read_bytes() != contents[0]


def test_cli_fixture_usage_errors_exit_2() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["fixture", "x.safetensors", "--attention", "mla"])
    assert result.exit_code == 2
    assert "--latent-dim" in result.output
    result = runner.invoke(app, ["fixture", "x.safetensors", "--lengths", "4,x"])
    assert result.exit_code == 2
    assert "--lengths" in result.output
    result = runner.invoke(app, ["fixture", "x.safetensors", "--head-dim", "15"])
    assert result.exit_code == 2
    assert "even head_dim" in result.output
