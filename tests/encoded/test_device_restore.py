"""An fp8 snapshot restored by moving its e4m3 bytes and scales and dequantizing where they land
(kvsnap/encoded/device_restore.py): every layout, TP split and dtype gets bit for bit what the
host decode gives, for all sequences or one. On host memory the same code runs the kernel under
Triton's interpreter; on CUDA (marked ``gpu``) ``Snapshot.restore`` takes this path itself."""

from __future__ import annotations

import pytest
import torch

import kvsnap
from kvsnap.encoded.device_restore import fp8_restorable, restore_fp8_on_device
from kvsnap.encoded.write import encode_file
from kvsnap.testing.caches import KVContent, make_cache, same_bytes
from tests.support.encoded_files import capture_real


def _fp8_file(tmp_path, kind: str, dtype: torch.dtype):
    source = tmp_path / "kv.safetensors"
    capture_real(source, "mla" if kind == "mla" else "vllm-nhd", dtype)
    target = tmp_path / "kv.fp8.safetensors"
    encode_file(source, target, "fp8", measure_error=False)
    return target


def _caches(snapshot, kind: str, tp_size: int, dtype: torch.dtype, device: str):
    geometry = snapshot.geometry
    shape = (
        {"latent_dim": geometry.latent_dim}
        if geometry.is_mla
        else {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim}
    )
    return [
        make_cache(
            kind,
            num_layers=geometry.num_layers,
            num_blocks=snapshot.num_blocks + 3,
            block_size=geometry.block_size,
            dtype=dtype,
            device=device,
            tp_rank=rank,
            tp_size=tp_size,
            **shape,
        )
        for rank in range(tp_size)
    ]


def _restore_and_check(snapshot, caches, sequences, restore) -> None:
    block_ids, pairs = {}, {}
    for record in snapshot.sequences:
        if record.id in sequences:
            ids = [snapshot.num_blocks + 2 - int(b) for b in record.block_ids]
            block_ids[record.id] = ids
            pairs.update(zip(record.block_ids.tolist(), ids, strict=True))
    result = restore([cache.layout for cache in caches], block_ids)
    assert result.num_blocks == len(pairs)
    content = KVContent(
        snapshot.geometry,
        {name: snapshot.read_tensor(name) for name in snapshot.geometry.tensor_names()},
    )
    source, target = torch.tensor(list(pairs)), torch.tensor(list(pairs.values()))
    untouched = sorted(set(range(snapshot.num_blocks + 3)) - set(pairs.values()))
    for cache in caches:
        for name in cache.views:
            got = cache.logical(name).cpu()
            assert same_bytes(got[target], cache.expected(content, name, source)), name
            assert not got[torch.tensor(untouched)].view(torch.uint8).any(), name


@pytest.mark.parametrize(
    ("kind", "tp_size", "dtype"),
    [
        ("vllm-nhd", 1, torch.bfloat16),
        ("vllm-hnd", 2, torch.float16),
        ("packed", 1, torch.float32),
        ("mla", 1, torch.bfloat16),
    ],
)
def test_the_device_path_writes_what_the_host_decodes(monkeypatch, tmp_path, kind, tp_size, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kvsnap.Snapshot.open(_fp8_file(tmp_path, kind, dtype)) as snapshot:
        assert not fp8_restorable(
            snapshot.encoded, [_caches(snapshot, kind, 1, dtype, "cpu")[0].layout]
        )

        def restore(layouts, block_ids):
            return restore_fp8_on_device(snapshot, layouts, block_ids)

        for sequences in ({"a", "b"}, {"b"}):
            caches = _caches(snapshot, kind, tp_size, dtype, "cpu")
            _restore_and_check(snapshot, caches, sequences, restore)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind",
    [
        "vllm-nhd",
        "vllm-hnd",
        "vllm-legacy",
        "packed",
        "cross-layer",
        "flat-paged",
        "contiguous",
        "mla",
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_restore_moves_fp8_and_writes_what_the_host_decodes(tmp_path, kind, dtype):
    with kvsnap.Snapshot.open(_fp8_file(tmp_path, kind, dtype)) as snapshot:
        for tp_size in (1, 2) if kind in ("vllm-nhd", "vllm-hnd", "packed") else (1,):
            caches = _caches(snapshot, kind, tp_size, dtype, "cuda")
            assert fp8_restorable(snapshot.encoded, [cache.layout for cache in caches])

            def restore(layouts, block_ids):
                result = snapshot.restore(layouts, block_ids)
                assert result.backend == "fp8-dequant"
                return result

            _restore_and_check(snapshot, caches, {"a", "b"}, restore)
