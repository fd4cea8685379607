"""An fp8 snapshot with page checks opens without reading a page (kvsnap/encoded/fp8_open.py),
and every page is checked where a restore moves it: a page changed on disk is never written to
a cache (``RestoreIncompleteError`` names it; every other page is written), a co-writer without
the key who also rewrites the page's xxh3-64 and the trailer is caught by the signed BLAKE3
digest, the host decode refuses the same files, and the files written before page checks
still open, decode and restore. The device path runs here on host memory under Triton's
interpreter (the page checks on the host); tests/encoded/test_device_restore.py's CUDA tests
take the kernels' checks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.device_restore import restore_fp8_blocks, restore_fp8_on_device
from kvsnap.encoded.fp8_open import OpenFp8File
from kvsnap.encoded.original import parse_original, read_local
from kvsnap.encoded.write import _stored_tensors, container_pieces, container_specs, encode_file
from kvsnap.errors import (
    BadSignatureError,
    IncompatibleSnapshotError,
    RestoreIncompleteError,
    SnapshotCorruptError,
)
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import block_digests, digest128, encode_trailer
from kvsnap.format.signing import KeyRing
from kvsnap.testing.caches import make_cache
from tests.support.encoded_files import capture_real

KEY = KeyRing([bytes(range(32))])
PAGE = 0  # the stored block whose page is changed (sequence a's fifth block, b's none)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8open") / "kv.safetensors"
    capture_real(path, "vllm-nhd", torch.bfloat16)
    return path


def _encoded(source, tmp_path, keys=None):
    target = tmp_path / "kv.fp8.safetensors"
    encode_file(source, target, "fp8", keys=keys, measure_error=False)
    return target


def _rewrite(path, name: str, block: int, *, fix_pages: bool) -> None:
    """Change one byte of ``name``'s stored ``block``; with ``fix_pages`` also its xxh3-64 and
    the trailer, as a co-writer without the key could."""
    data = np.fromfile(path, dtype=np.uint8)
    layout = enc.parse_header(
        data[: enc.header_length(data[:8].tobytes(), len(data)) + 8].tobytes(), len(data)
    )
    stored = layout.by_name[name]
    page_bytes = stored.nbytes // stored.shape[0]
    data[stored.begin + block * page_bytes + 5] ^= 0x21
    if fix_pages:
        pages = layout.by_name[name + enc.PAGES_SUFFIX]
        values = data[stored.begin : stored.end]
        data[pages.begin : pages.end] = (
            block_digests(values, page_bytes).astype("<u8").view(np.uint8)
        )
        header = data[: layout.data_start].tobytes()
        rows = [digest128(header)] + [digest128(data[t.begin : t.end]) for t in layout.checksummed]
        trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
        data[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    data.tofile(path)


def _cache(snapshot):
    geometry = snapshot.geometry
    return make_cache(
        "vllm-nhd",
        num_layers=geometry.num_layers,
        num_blocks=snapshot.num_blocks + 2,
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=torch.bfloat16,
        device="cpu",
    )


def _device_restore(snapshot, cache):
    block_ids = {r.id: [int(b) + 1 for b in r.block_ids] for r in snapshot.sequences}
    return restore_fp8_on_device(snapshot, [cache.layout], block_ids)


def _host_decoded(path) -> dict[str, torch.Tensor]:
    with kvsnap.Snapshot.open(path) as snapshot:
        return {name: snapshot.read_tensor(name) for name in snapshot.geometry.tensor_names()}


def test_open_reads_the_header_and_checks_but_no_page(source, tmp_path, monkeypatch):
    path = _encoded(source, tmp_path)
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def recorded(fd, buffers, at):
        reads.append((at, at + sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, at)

    monkeypatch.setattr(os, "preadv", recorded)
    with kvsnap.Snapshot.open(path) as snapshot:
        assert isinstance(snapshot.encoded, OpenFp8File)
        assert [r.id for r in snapshot.sequences] == ["a", "b"]
        layout = snapshot.encoded.layout
        values = [layout.by_name[name] for name in layout.fp8_names()]
        assert reads and len(values) == 2 * snapshot.geometry.num_layers
        for begin, end in reads:
            assert not any(begin < v.end and v.begin < end for v in values), (begin, end)
        monkeypatch.setattr(os, "preadv", real_preadv)
        snapshot.read_tensor("layers.0.key")  # the decode reads them all
    # And the check has teeth: the decode's reads do cover the values.
    monkeypatch.setattr(os, "preadv", recorded)
    reads.clear()
    with kvsnap.Snapshot.open(path) as snapshot:
        snapshot.read_tensor("layers.0.key")
    assert any(begin < values[0].end and values[0].begin < end for begin, end in reads)


def test_a_changed_page_is_never_written_and_is_named(source, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _encoded(source, tmp_path)
    whole = _host_decoded(path)
    _rewrite(path, "layers.1.value", PAGE, fix_pages=False)
    with kvsnap.Snapshot.open(path) as snapshot:  # opens: no page is read
        cache = _cache(snapshot)
        with pytest.raises(RestoreIncompleteError, match="failed their checksum") as caught:
            _device_restore(snapshot, cache)
        assert caught.value.failed_block_ids.tolist() == [PAGE + 1]
        got = cache.logical("layers.1.value")
        assert not got[PAGE + 1].view(torch.int16).any()  # the changed page: never written
        others = [b for b in range(snapshot.num_blocks) if b != PAGE]
        assert torch.equal(
            got[[b + 1 for b in others]].view(torch.int16),
            whole["layers.1.value"][others].view(torch.int16),
        )
        # The host decode of the same file refuses it whole.
        with pytest.raises(SnapshotCorruptError, match="checksum mismatch"):
            snapshot.read_tensor("layers.0.key")


def _collide(snapshot, name: str) -> None:
    """Make the open file's stored xxh3-64 of ``name`` those of its pages on disk now: what a
    page crafted to collide with its xxh3-64 would look like (xxh3 is no defence against
    crafting; BLAKE3 is)."""
    stored = snapshot.encoded.layout.by_name[name]
    values = snapshot.encoded.read(stored.begin, stored.nbytes)
    digests = block_digests(values, stored.nbytes // stored.shape[0]).astype("<u8")
    snapshot.encoded.small[name + enc.PAGES_SUFFIX] = digests.view(np.uint8)


def test_a_page_colliding_with_its_checksum_is_caught_by_the_signed_digest(
    source, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _encoded(source, tmp_path, keys=KEY)
    _rewrite(path, "layers.0.key", PAGE, fix_pages=False)
    with kvsnap.Snapshot.open(path) as unkeyed:  # without keys, the collision would pass
        _collide(unkeyed, "layers.0.key")
        _device_restore(unkeyed, _cache(unkeyed))
    with kvsnap.Snapshot.open(path, keys=KEY) as snapshot:  # the small tensors are intact
        _collide(snapshot, "layers.0.key")
        cache = _cache(snapshot)
        with pytest.raises(RestoreIncompleteError, match="failed their signed digest") as caught:
            _device_restore(snapshot, cache)
        assert caught.value.failed_block_ids.tolist() == [PAGE + 1]
        assert not cache.logical("layers.0.key")[PAGE + 1].view(torch.int16).any()
        with pytest.raises(SnapshotCorruptError, match="checksum mismatch"):
            snapshot.read_tensor("layers.0.key")  # the host decode checks the file whole


def test_a_cowriter_rewriting_page_checks_is_refused_at_a_keyed_open(source, tmp_path):
    path = _encoded(source, tmp_path, keys=KEY)
    _rewrite(path, "layers.0.key", PAGE, fix_pages=True)
    kvsnap.Snapshot.open(path).close()  # its checksums agree: unkeyed, it opens
    with pytest.raises(BadSignatureError):
        kvsnap.Snapshot.open(path, keys=KEY)


def test_a_signed_file_opens_with_its_key_only(source, tmp_path):
    path = _encoded(source, tmp_path, keys=KEY)
    with kvsnap.Snapshot.open(path, keys=KEY) as snapshot:
        assert snapshot.encoded.signed_pages
        assert snapshot.encoded.encoding["signature"] == enc.PAGES_SIGNATURE_ALGORITHM
    with pytest.raises(BadSignatureError):
        kvsnap.Snapshot.open(path, keys=KeyRing([bytes(32)]))
    # Scales are signed whole: one changed (trailer fixed) fails the signature at open.
    data = np.fromfile(path, dtype=np.uint8)
    layout = enc.parse_header(
        data[: enc.header_length(data[:8].tobytes(), len(data)) + 8].tobytes(), len(data)
    )
    scales = layout.by_name["layers.0.key" + enc.SCALES_SUFFIX]
    data[scales.begin : scales.begin + 4] = np.array([0.5], dtype="<f4").view(np.uint8)
    rows = [digest128(data[: layout.data_start].tobytes())] + [
        digest128(data[t.begin : t.end]) for t in layout.checksummed
    ]
    trailer = layout.by_name[enc.ENCODED_CHECKSUMS_TENSOR]
    data[trailer.begin : trailer.end] = np.frombuffer(encode_trailer(rows), dtype=np.uint8)
    data.tofile(path)
    kvsnap.Snapshot.open(path).close()  # unkeyed: the checksums agree
    with pytest.raises(BadSignatureError):
        kvsnap.Snapshot.open(path, keys=KEY)


def test_the_device_path_restores_what_the_host_decodes(source, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _encoded(source, tmp_path, keys=KEY)
    whole = _host_decoded(path)
    with kvsnap.Snapshot.open(path, keys=KEY) as snapshot:
        cache = _cache(snapshot)
        result = _device_restore(snapshot, cache)
        assert result.backend == "fp8-dequant" and result.num_blocks == snapshot.num_blocks
        for name, pages in whole.items():
            got = cache.logical(name)[1 : snapshot.num_blocks + 1]
            assert torch.equal(got.view(torch.int16), pages.view(torch.int16)), name


def test_a_file_replaced_after_open_is_decoded_from_the_one_opened(source, tmp_path):
    path = _encoded(source, tmp_path)
    whole = _host_decoded(path)
    with kvsnap.Snapshot.open(path) as snapshot:
        other = tmp_path / "other.safetensors"
        capture_real(other, "vllm-nhd", torch.bfloat16)
        encode_file(other, tmp_path / "replacement.safetensors", "lossless")
        os.replace(tmp_path / "replacement.safetensors", path)
        for name, pages in whole.items():
            assert torch.equal(
                snapshot.read_tensor(name).view(torch.int16), pages.view(torch.int16)
            )


def test_files_written_before_page_checks_still_open_and_restore(source, tmp_path):
    """An fp8 file as kvsnap wrote it before page checks (no ``.pages``, no ``page_checks``,
    the whole-tensor signature) decodes at open and restores the same KV."""
    original = parse_original(read_local(source), str(source))
    stored = _stored_tensors(original, "fp8", None)
    document = {
        "format_version": enc.ENCODED_FORMAT_VERSION,
        "kvsnap_version": "0.5.0",
        "encoding": {
            "name": "fp8",
            "codec": "kvsnap-fp8-e4m3-v1",
            "decoded_bytes": len(original.data),
            "tensors": stored.kinds,
            "signature": enc.SIGNATURE_ALGORITHM,
            "error": None,
        },
    }
    old = tmp_path / "old.safetensors"
    specs = container_specs([(name, dtype, shape) for name, dtype, shape, _ in stored.items], KEY)
    header, layout = enc.build_layout(document, specs)
    data = {name: array for name, _, _, array in stored.items}
    pieces = [header, *(piece for _, piece in container_pieces(header, layout, data, KEY))]
    with open(old, "wb") as stream:
        for piece in pieces:
            stream.write(
                piece if isinstance(piece, bytes) else np.ascontiguousarray(piece).tobytes()
            )
    new = _encoded(source, tmp_path)
    with kvsnap.Snapshot.open(old, keys=KEY) as snapshot:
        assert not isinstance(snapshot.encoded, OpenFp8File)
        assert snapshot.encoded.layout.page_checks == ()
        decoded_old = {n: snapshot.read_tensor(n) for n in snapshot.geometry.tensor_names()}
    for name, pages in _host_decoded(new).items():
        assert torch.equal(decoded_old[name].view(torch.int16), pages.view(torch.int16)), name
    with pytest.raises(BadSignatureError):
        kvsnap.Snapshot.open(old, keys=KeyRing([bytes(32)]))


def test_an_open_after_a_checked_one_still_refuses_changed_bytes(source, tmp_path):
    """Opens of bytes checked before skip the checks; any other bytes are checked again."""
    path = _encoded(source, tmp_path)
    kvsnap.Snapshot.open(path).close()
    kvsnap.Snapshot.open(path).close()  # the same bytes: served from what was checked
    data = np.fromfile(path, dtype=np.uint8)
    layout = enc.parse_header(
        data[: enc.header_length(data[:8].tobytes(), len(data)) + 8].tobytes(), len(data)
    )
    scales = layout.by_name["layers.1.value" + enc.SCALES_SUFFIX]
    data[scales.begin] ^= 0x01  # a scale's lowest bit: still a valid scale, the trailer stale
    data.tofile(path)
    with pytest.raises(SnapshotCorruptError, match="checksum mismatch") as caught:
        kvsnap.Snapshot.open(path)
    assert caught.value.tensor == "layers.1.value" + enc.SCALES_SUFFIX


def test_a_path_that_held_an_fp8_file_opens_what_it_holds_now(source, tmp_path):
    path = _encoded(source, tmp_path)
    kvsnap.Snapshot.open(path).close()  # remembered as encoded
    plain = tmp_path / "plain.safetensors"
    plain.write_bytes(source.read_bytes())
    os.replace(plain, path)
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.encoded is None and snapshot.verify() == []


def test_blocks_restore_as_an_engine_worker_loads_a_chunk(source, tmp_path, monkeypatch):
    """``restore_fp8_blocks`` (the vLLM worker's call for an fp8 chunk on a CUDA cache): stored
    blocks into chosen target blocks, bit for bit the host decode, ids checked first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _encoded(source, tmp_path)
    whole = _host_decoded(path)
    with kvsnap.Snapshot.open(path) as snapshot:
        cache = _cache(snapshot)
        sources, targets = [3, 0, 5], [11, 2, 7]
        result = restore_fp8_blocks(snapshot, [cache.layout], sources, targets)
        assert result.num_blocks == 3 and result.backend == "fp8-dequant"
        for name, pages in whole.items():
            got = cache.logical(name)
            for source_block, target_block in zip(sources, targets, strict=True):
                assert torch.equal(
                    got[target_block].view(torch.int16), pages[source_block].view(torch.int16)
                )
            untouched = sorted(set(range(snapshot.num_blocks + 2)) - set(targets))
            assert not got[untouched].view(torch.int16).any()
        with pytest.raises(IncompatibleSnapshotError, match="outside the snapshot"):
            restore_fp8_blocks(snapshot, [cache.layout], [snapshot.num_blocks], [0])
        with pytest.raises(IncompatibleSnapshotError, match="two different snapshot blocks"):
            restore_fp8_blocks(snapshot, [cache.layout], [0, 1], [4, 4])
