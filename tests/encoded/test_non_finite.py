"""fp8 snapshots of KV that holds infinities and NaNs: the built-in model's KV with a few planted
in some heads, and pages of random bits (every finite magnitude of the dtype, up to 3.4e38,
and about one value in 256, in bf16, not finite). A capture, ``encode_file``, ``kvsnap convert``
and ``recode_file`` all write a file that opens: its error report is finite (strict JSON),
counts the non-finite elements it left out, and ``verify --against`` the original measures the
same; a restore gives NaN back as the dtype's quiet NaN, an infinity as +-448 times its scale
(e4m3 has no infinity: docs/format.md), and every other value within the recorded error. No
writer of an encoded file writes a NaN or an infinity into its header."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file, recode_file
from kvsnap.encoding import fp8
from kvsnap.encoding.report import AttentionError, ErrorReport, TensorError
from kvsnap.format import encoded as enc
from kvsnap.format.schema import strict_json_loads
from kvsnap.testing.caches import KVContent, make_cache, same_bytes
from tests.support.cli_runs import run_kvsnap
from tests.support.encoded_files import content_named, filled_caches, real_sequences
from tests.support.format_doc import decoded_file

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
#: (content, dtype, cache layout): planted values and random bits in each dtype.
CASES = [
    pytest.param(("planted", BF16, "vllm-nhd"), id="planted-bf16"),
    pytest.param(("planted", F16, "mla"), id="planted-f16-mla"),
    pytest.param(("random-bits", BF16, "vllm-nhd"), id="random-bits-bf16"),
    pytest.param(("random-bits", F16, "vllm-hnd"), id="random-bits-f16"),
    pytest.param(("random-bits", F32, "packed"), id="random-bits-f32"),
]


def _captured(folder: Path, content_name: str, dtype: torch.dtype, kind: str) -> dict[str, Path]:
    """A plain capture of the content from a cache of ``kind`` and its fp8 capture."""
    (cache,) = filled_caches(content_named(content_name, dtype, kind), kind)
    paths = {name: folder / f"{name}.safetensors" for name in ("plain", "fp8")}
    kvsnap.capture(cache.layout, real_sequences(), paths["plain"], reproducible=True)
    kvsnap.capture(
        cache.layout, real_sequences(), paths["fp8"], reproducible=True, compression="fp8"
    )
    return paths


@pytest.fixture(scope="module", params=CASES)
def files(request, tmp_path_factory) -> tuple[dict[str, Path], torch.dtype]:
    content_name, dtype, kind = request.param
    folder = tmp_path_factory.mktemp(f"{content_name}-{kind}")
    return _captured(folder, content_name, dtype, kind), dtype


def _held(snapshot: kvsnap.Snapshot) -> torch.Tensor:
    """``(blocks, block_size)`` booleans: the tokens the snapshot's sequences hold."""
    counts = torch.from_numpy(snapshot.valid_tokens_per_block())
    return torch.arange(snapshot.geometry.block_size)[None, :] < counts[:, None]


def _heads(pages: torch.Tensor) -> torch.Tensor:
    return pages.unsqueeze(2) if pages.dim() == 3 else pages


def _pages(path: Path) -> dict[str, torch.Tensor]:
    with kvsnap.Snapshot.open(path) as snapshot:
        return {name: snapshot.read_tensor(name) for name in snapshot.geometry.tensor_names()}


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [number for item in value.values() for number in _numbers(item)]
    if isinstance(value, list):
        return [number for item in value for number in _numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def test_the_file_opens_and_its_report_counts_what_it_left_out(files):
    paths, _ = files
    original, decoded = _pages(paths["plain"]), _pages(paths["fp8"])
    with kvsnap.Snapshot.open(paths["plain"]) as plain:
        held = _held(plain)[:, :, None, None]
    with kvsnap.Snapshot.open(paths["fp8"]) as snapshot:
        report = snapshot.encoded.error
    assert all(math.isfinite(number) for number in _numbers(report.to_dict()))
    planted = 0
    for item in report.tensors:
        x, y = _heads(original[item.tensor]), _heads(decoded[item.tensor])
        bad = (~torch.isfinite(x) | ~torch.isfinite(y)) & held
        # Counted where the original or its decode is not finite, over the tokens held; the
        # other figures are over the rest.
        assert item.non_finite == int(bad.sum()), item.tensor
        assert item.values + item.non_finite == int(held.expand_as(x).sum())
        assert 0 <= item.rms_rel and -1 <= item.min_cosine <= item.mean_cosine <= 1
        planted += int((~torch.isfinite(x) & held).sum())
    assert report.worst["non_finite"] >= planted > 0


def test_a_restore_gives_the_planted_values_back_as_documented(files):
    paths, dtype = files
    original, decoded = _pages(paths["plain"]), _pages(paths["fp8"])
    stored = read_encoded(paths["fp8"])
    with kvsnap.Snapshot.open(paths["fp8"]) as snapshot:
        held = _held(snapshot)[:, :, None, None]
        report = {item.tensor: item for item in snapshot.encoded.error.tensors}
        _check_a_restore(snapshot, decoded)
    nan_bits = fp8.CANONICAL_NAN_BITS[dtype]
    bits = {BF16: torch.int16, F16: torch.int16, F32: torch.int32}[dtype]
    for name, pages in original.items():
        x, y = _heads(pages), _heads(decoded[name])
        scales = torch.from_numpy(stored.tensor(name + enc.SCALES_SUFFIX).view(np.float32).copy())
        scales = scales.reshape(x.shape[0], x.shape[2])[:, None, :, None].expand_as(x)
        nan, infinite = torch.isnan(x) & held, torch.isinf(x) & held
        # NaN decodes to the dtype's quiet NaN; an infinity saturates to +-448 of its scale.
        assert (y.contiguous().view(bits)[nan] == nan_bits).all(), name
        saturated = (torch.sign(x[infinite]) * 448.0 * scales[infinite]).to(dtype)
        assert same_bytes(y[infinite], saturated), name
        # Every other value within the recorded error (kept to 6 digits).
        finite = torch.isfinite(x) & torch.isfinite(y) & held
        error = torch.where(finite, (y.double() - x.double()).abs(), 0.0)
        top = torch.where(finite, x.double().abs(), 0.0).amax(dim=(1, 2, 3))
        assert error.max() <= report[name].max_abs * (1 + 1e-5), name
        limit = report[name].max_abs_rel_block * top * (1 + 1e-5)
        assert (error.amax(dim=(1, 2, 3)) <= limit).all(), name


def test_the_format_docs_recipe_decodes_them_as_kvsnap_does(files):
    # docs/format.md's decoding, without kvsnap: NaN codes and saturated infinities included.
    paths, _ = files
    assert decoded_file(paths["fp8"]) == decode(read_encoded(paths["fp8"])).tobytes()


def _check_a_restore(snapshot: kvsnap.Snapshot, decoded: dict[str, torch.Tensor]) -> None:
    """Restore every sequence into a fresh cache, blocks reversed: the pages it holds are the
    snapshot's decoded ones, bit for bit (NaNs canonical)."""
    geometry = snapshot.geometry
    shape = (
        {"latent_dim": geometry.latent_dim}
        if geometry.is_mla
        else {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim}
    )
    cache = make_cache(
        "vllm-hnd" if not geometry.is_mla else "mla",
        num_layers=geometry.num_layers,
        num_blocks=snapshot.num_blocks + 1,
        block_size=geometry.block_size,
        dtype=next(iter(decoded.values())).dtype,
        **shape,
    )
    targets: dict[int, int] = {}
    block_ids = {}
    for record in snapshot.sequences:
        block_ids[record.id] = [snapshot.num_blocks - int(b) for b in record.block_ids]
        targets.update(zip(record.block_ids.tolist(), block_ids[record.id], strict=True))
    snapshot.restore([cache.layout], block_ids)
    source, target = torch.tensor(list(targets)), torch.tensor(list(targets.values()))
    content = KVContent(geometry, decoded)
    for name in cache.views:
        want = cache.expected(content, name, source)
        assert same_bytes(cache.logical(name)[target], want), name


def test_every_encoder_writes_the_same_file_and_a_recode_opens(files, tmp_path):
    paths, _ = files
    encoded, converted = tmp_path / "encoded.safetensors", tmp_path / "converted.safetensors"
    encode_file(paths["plain"], encoded, "fp8")
    run = run_kvsnap("convert", str(paths["plain"]), "-o", str(converted), "--compress", "fp8")
    assert run.returncode == 0, run.stderr
    assert encoded.read_bytes() == converted.read_bytes() == paths["fp8"].read_bytes()
    # Written as fp8 again, an fp8 file is kept as it is. Its decoded file encoded again is
    # measured against its decoded pages: their NaNs are counted (and infinities where +-448
    # scales passed the dtype's range), the other saturated infinities are finite values like
    # the rest.
    kept, decoded_file = tmp_path / "kept.safetensors", tmp_path / "decoded.safetensors"
    recode_file(paths["fp8"], kept, "fp8")
    assert kept.read_bytes() == paths["fp8"].read_bytes()
    recode_file(paths["fp8"], decoded_file, "none")
    recoded = tmp_path / "recoded.safetensors"
    encode_file(decoded_file, recoded, "fp8")
    decoded, original = _pages(paths["fp8"]), _pages(paths["plain"])
    saturated = infinities = 0
    with kvsnap.Snapshot.open(recoded) as snapshot:
        held = _held(snapshot)[:, :, None, None]
        for item in snapshot.encoded.error.tensors:
            pages = _heads(decoded[item.tensor])
            assert item.non_finite == int((~torch.isfinite(pages) & held).sum()), item.tensor
            infinite = torch.isinf(_heads(original[item.tensor])) & held
            saturated += int((infinite & torch.isfinite(pages)).sum())
            infinities += int(infinite.sum())
    assert saturated > 0 or infinities == 0  # random fp32 bits hold NaNs, not an infinity


def test_inspect_shows_the_report_and_verify_against_the_original_agrees(files):
    paths, _ = files
    with kvsnap.Snapshot.open(paths["fp8"]) as snapshot:
        recorded = snapshot.encoded.error
    run = run_kvsnap("inspect", str(paths["fp8"]), "--json")
    assert run.returncode == 0, run.stderr
    shown = strict_json_loads(run.stdout)["encoding"]["error"]  # no NaN, no Infinity
    assert shown["report"] == recorded.to_dict() and shown["worst"] == recorded.worst
    text = run_kvsnap("inspect", str(paths["fp8"]))
    assert f"non-finite {int(recorded.worst['non_finite'])}" in " ".join(text.stdout.split())
    run = run_kvsnap("verify", str(paths["fp8"]), "--against", str(paths["plain"]), "--json")
    checked = strict_json_loads(run.stdout)
    assert run.returncode == 0 and checked["ok"] and checked["problems"] == [], run.stdout
    assert checked["error"]["measured"] == checked["error"]["recorded"] == recorded.worst


def test_a_report_with_a_nan_is_never_written():
    good = TensorError("layers.0.key", 10, 0.1, 0.03, 0.02, 0.999, 0.9995, 0.0, 0)
    attention = (AttentionError(0, 48, 0.01, 0.999, 0.9999),)
    for bad in (
        TensorError("layers.0.key", 10, 0.1, 0.03, math.nan, 0.999, 0.9995, 0.0, 0),
        TensorError("layers.0.key", 10, math.inf, 0.03, 0.02, 0.999, 0.9995, 0.0, 0),
    ):
        report = ErrorReport(fp8.NAME, "block-head", "keys", (good, bad), attention)
        with pytest.raises(ValueError, match=r"layers\.0\.key (rms_rel|max_abs) is (nan|inf)"):
            report.to_dict()
    report = ErrorReport(
        fp8.NAME, "block-head", "keys", (good,), (AttentionError(0, 48, math.nan, 1.0, 1.0),)
    )
    with pytest.raises(ValueError, match="layer 0 rel_l2 is nan"):
        report.to_dict()
    # The header writer itself refuses one, whatever put it in the metadata.
    document = {"format_version": 3, "encoding": {"name": "fp8", "error": {"x": [math.nan]}}}
    with pytest.raises(ValueError, match="JSON"):
        enc.build_layout(document, [("kvsnap.x", "U8", (3,))])
    document["encoding"]["error"] = {"x": [-math.inf]}
    with pytest.raises(ValueError, match="JSON"):
        enc.build_layout(document, [("kvsnap.x", "U8", (3,))])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [case.values[0] for case in CASES], ids=[c.id for c in CASES])
def test_on_cuda_a_capture_is_the_host_caches_and_verifies_against_its_original(tmp_path, case):
    """The device path (kvsnap/encoded/capture.py: gathered, quantized and measured on the
    GPU) writes what the capture of host caches writes, and the file opens and verifies."""
    content_name, dtype, kind = case
    content = content_named(content_name, dtype, kind)
    paths = {name: tmp_path / f"{name}.safetensors" for name in ("cuda", "host", "plain")}
    spans: list[str] = []
    for device in ("cuda", "cpu"):
        (cache,) = filled_caches(content, kind, 1, device)
        kvsnap.capture(
            cache.layout,
            real_sequences(),
            paths["cuda" if device == "cuda" else "host"],
            reproducible=True,
            compression="fp8",
            trace=(lambda span, *_: spans.append(span)) if device == "cuda" else None,
        )
        if device == "cuda":
            kvsnap.capture(cache.layout, real_sequences(), paths["plain"], reproducible=True)
    assert "encoded.tensor" in spans and "setup.writer" not in spans  # the device path
    assert paths["cuda"].read_bytes() == paths["host"].read_bytes()
    with kvsnap.Snapshot.open(paths["cuda"]) as snapshot:
        assert snapshot.encoded.error.worst["non_finite"] > 0
        assert all(math.isfinite(n) for n in _numbers(snapshot.encoded.error.to_dict()))
    run = run_kvsnap("verify", str(paths["cuda"]), "--against", str(paths["plain"]), "--json")
    assert run.returncode == 0 and strict_json_loads(run.stdout)["ok"], run.stdout
