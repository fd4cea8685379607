"""``Snapshot.compare`` (``kvsnap diff``) computes every number of its report correctly: checked
against a reference computed with torch, in float64, over whole tensors, on real snapshot files
of random KV with NaN and Inf in them, in two dtypes and two block sizes, streamed in steps far
smaller than a tensor (so every step boundary, the prefetch and the merges are exercised)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.analysis import diff, reads
from kvsnap.snapshot import Snapshot
from kvsnap.testing.golden import KVData, KVSequenceData, write_kv_snapshot

LAYERS, HEADS, DIM = 2, 3, 16
LENGTHS = {"s0": 37, "s1": 21}
NAMES = [f"layers.{layer}.{part}" for layer in range(LAYERS) for part in ("key", "value")]


def _data(tensors: dict[str, dict[str, torch.Tensor]]) -> KVData:
    sequences = [
        KVSequenceData(sequence, np.arange(count) + 7 * index, tensors[sequence])
        for index, (sequence, count) in enumerate(LENGTHS.items())
    ]
    return KVData(sequences, NAMES)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, dict]:
    """A (bfloat16, 8 tokens a block) and B (float32, 16 a block): B is A's values plus noise
    of growing size per layer, and one element changed a lot; NaN in A only, the same +Inf in
    both, -Inf in B against a finite A."""
    generator = torch.Generator().manual_seed(3)
    a: dict[str, dict[str, torch.Tensor]] = {}
    b: dict[str, dict[str, torch.Tensor]] = {}
    for sequence, count in LENGTHS.items():
        a[sequence], b[sequence] = {}, {}
        for number, name in enumerate(NAMES):
            values = torch.randn(count, HEADS, DIM, generator=generator).bfloat16()
            noise = torch.randn(count, HEADS, DIM, generator=generator) * 1e-3 * number
            a[sequence][name] = values
            b[sequence][name] = values.float() + noise
    b["s1"]["layers.1.key"][4, 2, 9] += 3.0  # the largest difference
    a["s0"]["layers.0.value"][5, 1, 3] = float("nan")
    a["s0"]["layers.1.value"][2, 0, 0] = float("inf")
    b["s0"]["layers.1.value"][2, 0, 0] = float("inf")
    b["s1"]["layers.0.key"][3, 2, 1] = float("-inf")
    directory = tmp_path_factory.mktemp("diff-numbers")
    write_kv_snapshot(_data(a), directory / "a.safetensors", block_size=8)
    write_kv_snapshot(_data(b), directory / "b.safetensors", block_size=16)
    return directory / "a.safetensors", directory / "b.safetensors", a, b


def _reference(a: dict, b: dict, name: str, atol: float, rtol: float) -> dict:
    """Every number of one tensor, from whole tensors in float64."""
    first = torch.cat([a[sequence][name].double() for sequence in LENGTHS])
    second = torch.cat([b[sequence][name].double() for sequence in LENGTHS])
    finite = torch.isfinite(first) & torch.isfinite(second)
    same = ~torch.isfinite(first) & ~torch.isfinite(second)
    same &= (first == second) | (torch.isnan(first) & torch.isnan(second))
    unequal = ~finite & ~same
    first, second = torch.where(finite, first, 0.0), torch.where(finite, second, 0.0)
    diff = (first - second).abs()
    over = (diff > atol + rtol * second.abs()) | unequal
    valid = finite.all(dim=-1)
    norm_a, norm_b = first.norm(dim=-1), second.norm(dim=-1)
    larger = torch.maximum(norm_a, norm_b)
    relative = torch.where(larger > 0, diff.norm(dim=-1) / larger, 0.0)[valid]
    cosine = ((first * second).sum(-1) / (norm_a * norm_b))[valid]
    return {
        "max_abs_diff": float(diff.max()),
        "num_mismatches": int(over.sum()),
        "num_elements": over.numel(),
        "rms_diff": float(diff.pow(2).mean().sqrt()),
        "rel_error_mean": float(relative.mean()),
        "rel_error_max": float(relative.max()),
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "head_max": diff.amax(dim=(0, 2)).tolist(),
        "head_mismatches": over.sum(dim=(0, 2)).tolist(),
        "unequal": int(unequal.sum()),
        "both": int(same.sum()),
        "vectors": int((~valid).sum()),
    }


@pytest.mark.parametrize(
    ("step_bytes", "piece_elements"),
    [(reads.STEP_BYTES, diff.PIECE_ELEMENTS), (256, diff.PIECE_ELEMENTS), (4096, 100)],
    ids=["whole", "tiny-steps", "steps-in-pieces"],
)
def test_every_number_matches_a_float64_reference(
    pair: tuple[Path, Path, dict, dict],
    step_bytes: int,
    piece_elements: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reads, "STEP_BYTES", step_bytes)
    monkeypatch.setattr(diff, "PIECE_ELEMENTS", piece_elements)
    path_a, path_b, a, b = pair
    with Snapshot.open(path_a) as first, Snapshot.open(path_b) as second:
        comparison = first.compare(second, atol=1e-3, rtol=1e-2, top=5)
    assert [layer.tensor for layer in comparison.layers] == NAMES
    for layer in comparison.layers:
        expected = _reference(a, b, layer.tensor, 1e-3, 1e-2)
        assert layer.num_elements == expected["num_elements"]
        assert layer.num_mismatches == expected["num_mismatches"], layer.tensor
        assert layer.max_abs_diff == pytest.approx(expected["max_abs_diff"], rel=1e-6)
        assert layer.rms_diff == pytest.approx(expected["rms_diff"], rel=1e-4)
        assert layer.rel_error_mean == pytest.approx(expected["rel_error_mean"], rel=1e-4)
        assert layer.rel_error_max == pytest.approx(expected["rel_error_max"], rel=1e-4)
        assert layer.cosine_min == pytest.approx(expected["cosine_min"], abs=1e-6)
        assert layer.cosine_mean == pytest.approx(expected["cosine_mean"], abs=1e-6)
        assert [head.max_abs_diff for head in layer.heads] == pytest.approx(expected["head_max"])
        assert [head.num_mismatches for head in layer.heads] == expected["head_mismatches"]
        assert layer.nonfinite.mismatches == expected["unequal"]
        assert layer.nonfinite.both == expected["both"]
        assert layer.nonfinite.vectors == expected["vectors"]
    # The largest difference, located; the top 5 over every tensor, largest first.
    largest = max(comparison.layers, key=lambda layer: layer.max_abs_diff)
    at = largest.max_at
    assert at is not None and (at.tensor, at.sequence, at.token, at.head, at.channel) == (
        "layers.1.key",
        "s1",
        4,
        2,
        9,
    )
    assert at.b - at.a == pytest.approx(3.0, abs=0.01)
    everything = sorted(
        (
            abs(float(a[s][n][t, h, c]) - float(b[s][n][t, h, c]))
            for s in LENGTHS
            for n in NAMES
            for t, h, c in np.ndindex(LENGTHS[s], HEADS, DIM)
            if np.isfinite(float(a[s][n][t, h, c])) and np.isfinite(float(b[s][n][t, h, c]))
        ),
        reverse=True,
    )
    assert [entry.abs_diff for entry in comparison.top] == pytest.approx(everything[:5], rel=1e-6)


def test_nan_and_inf_are_never_equal_silently(pair: tuple[Path, Path, dict, dict]) -> None:
    path_a, path_b, _, _ = pair
    with Snapshot.open(path_a) as first, Snapshot.open(path_b) as second:
        comparison = first.compare(second, atol=10.0)  # a tolerance no finite difference breaks
    by_name = {layer.tensor: layer for layer in comparison.layers}
    # NaN in A only, and -Inf in B only: mismatches whatever the tolerance.
    assert by_name["layers.0.value"].nonfinite.nan_a == 1
    assert by_name["layers.0.value"].num_mismatches == 1
    assert by_name["layers.0.key"].nonfinite.inf_b == 1
    assert by_name["layers.0.key"].first_mismatch == {
        "sequence": "s1",
        "token": 3,
        "head": 2,
        "channel": 1,
    }
    # The same +Inf in both: not a difference, but counted and named in the report.
    assert by_name["layers.1.value"].num_mismatches == 0
    assert by_name["layers.1.value"].nonfinite.both == 1
    assert not comparison.ok
    report = " ".join(comparison.report().split())
    assert "layers.1.value: NaN 0 in A, 0 in B; Inf 1 in A, 1 in B" in report
    assert "1 hold the same NaN/Inf in both" in report


def test_reads_are_bounded_by_the_step_whatever_the_tensor(
    pair: tuple[Path, Path, dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded: no read is larger than one step (plus a block), however large the
    tensors, and two buffers per snapshot serve every step."""
    monkeypatch.setattr(reads, "STEP_BYTES", 1024)
    path_a, path_b, _, _ = pair
    sizes: list[int] = []
    with Snapshot.open(path_a) as first, Snapshot.open(path_b) as second:
        for snapshot in (first, second):
            reader = snapshot.parts[0].reader
            original = reader.read_pages_async

            def recording(name, block_ids, out, *, trace=None, original=original):
                sizes.append(out.nbytes)
                return original(name, block_ids, out, trace=trace)

            monkeypatch.setattr(reader, "read_pages_async", recording)
        comparison = first.compare(second)
    page = max(16 * HEADS * DIM * 4, 8 * HEADS * DIM * 2)
    assert sizes and max(sizes) <= 1024 + 2 * page
    assert len(sizes) > 4 * len(NAMES)  # many steps per tensor
    assert comparison.layers[0].num_elements == sum(LENGTHS.values()) * HEADS * DIM


def test_a_parted_snapshot_compares_as_the_whole_one(tmp_path: Path) -> None:
    """A parted snapshot's heads are put back in place: compared with the same KV in one file
    it is identical, and against other KV it gives the very numbers the single file gives."""
    from kvsnap.snapshot import capture
    from tests.support import parts_helpers as helpers

    parted, whole, other = (tmp_path / f"{name}.safetensors" for name in ("p", "w", "o"))
    helpers.parted_snapshot(parted, heads=8, tp=2, seed=1)
    for path, seed in ((whole, 1), (other, 2)):
        ranks, _ = helpers.filled("vllm-nhd", 1, 8, seed)
        capture(ranks[0].layout, helpers.sequences(1), path, source=helpers.SOURCE)
    with Snapshot.open(parted) as p, Snapshot.open(whole) as w, Snapshot.open(other) as o:
        assert len(p.parts) == 2
        same = p.compare(w)
        assert same.ok and all(layer.max_abs_diff == 0 for layer in same.layers)
        from_parts, from_file = p.compare(o), w.compare(o)
    assert [layer.to_dict() for layer in from_parts.layers] == [
        layer.to_dict() for layer in from_file.layers
    ]
    assert from_parts.top == from_file.top and from_parts.top


def test_the_dtype_and_block_size_differences_are_stated_up_front(
    pair: tuple[Path, Path, dict, dict],
) -> None:
    path_a, path_b, _, _ = pair
    with Snapshot.open(path_a) as first, Snapshot.open(path_b) as second:
        comparison = first.compare(second, atol=1.0)
        same = first.compare(first)
    stated = {(source.field, source.a, source.b) for source in comparison.sources}
    assert {("dtype", "bfloat16", "float32"), ("block size", "8", "16")} <= stated
    assert "dtype" in comparison.report().split("\n\n")[0]
    assert same.sources == []


def test_the_old_comparison_dtype_warns_at_the_callers_line() -> None:
    from kvsnap.analysis import comparison_dtype

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        wide = comparison_dtype("bfloat16", "float64")
    [warning] = caught
    assert issubclass(warning.category, DeprecationWarning)
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert wide is torch.float64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert comparison_dtype("bfloat16", "float16") is torch.float32
