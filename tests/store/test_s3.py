"""Snapshots on S3, against a real S3-protocol server (moto) on loopback, through fsspec/s3fs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.base import tuning
from tests.support.store_helpers import (
    GEOMETRIES,
    make_metadata,
    random_pages,
    shared_prefix_tokens,
    write_snapshot,
)

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "kvsnap-test"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 and the fsspec storage options that reach it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=BUCKET)
    try:
        yield options
    finally:
        server.stop()


def build(extra_blocks: int, seed: int) -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    geometry = GEOMETRIES["f16-32k"]
    metadata = make_metadata(
        geometry, shared_prefix_tokens(rng, geometry.block_size), extra_blocks=extra_blocks
    )
    return metadata, random_pages(rng, metadata)


def test_streaming_multipart_upload_round_trip(
    s3: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 5 MiB parts (S3's minimum) so an 11 MiB snapshot needs a real multipart upload.
    monkeypatch.setattr(tuning, "STREAM_BLOCK_BYTES", 5 << 20)
    metadata, pages = build(extra_blocks=80, seed=40)
    url = f"s3://{BUCKET}/round/snap.safetensors"
    info = write_snapshot(url, metadata, pages, rng=np.random.default_rng(41), storage_options=s3)
    assert info.path == url and info.num_bytes > 10 << 20  # three parts of 5 MiB or less
    fs = s3fs.S3FileSystem(**s3)
    assert "-" in fs.info(url)["ETag"].strip('"')  # a multipart upload's ETag is "<md5>-<parts>"
    # The object is byte for byte the snapshot a local write produces.
    local = tmp_path / "snap.safetensors"
    write_snapshot(local, metadata, pages)
    assert fs.cat_file(url) == local.read_bytes()
    with SnapshotReader(url, storage_options=s3) as reader:
        assert reader.metadata == metadata
        assert reader.verify() == []
        page = metadata.geometry.canonical_page_size_bytes
        ids = np.array([3, 4, 5, 40, 7])
        out = np.empty(len(ids) * page, dtype=np.uint8)
        reader.read_pages("layers.1.value", ids, out)
        data = pages["layers.1.value"]
        assert out.tobytes() == b"".join(
            data[b * page : (b + 1) * page].tobytes() for b in ids.tolist()
        )
        assert (
            reader.read_tensor("layers.0.key").view(torch.uint8).numpy().tobytes()
            == pages["layers.0.key"].tobytes()
        )


def test_aborted_upload_keeps_the_old_object(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "STREAM_BLOCK_BYTES", 5 << 20)
    metadata, pages = build(extra_blocks=80, seed=42)
    url = f"s3://{BUCKET}/abort/snap.safetensors"
    write_snapshot(url, metadata, pages, storage_options=s3)
    fs = s3fs.S3FileSystem(**s3)
    old = fs.cat_file(url)
    writer = SnapshotWriter(url, metadata, storage_options=s3)
    try:
        for name in writer.tensor_order()[:3]:  # several parts uploaded
            writer.write_pages(name, pages[name]).result()
    finally:
        # Always abort: an upload left open would be completed by its finalizer at exit,
        # against a server that is gone by then, and hang the test run.
        writer.abort()
    assert fs.cat_file(url) == old
    assert not fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads")


def test_sharded_snapshot_on_s3(s3: dict[str, Any]) -> None:
    metadata, pages = build(extra_blocks=4, seed=43)
    url = f"s3://{BUCKET}/sharded/snap.safetensors"
    write_snapshot(url, metadata, pages, storage_options=s3)
    limit = max(p.nbytes for p in pages.values()) + 1
    info = write_snapshot(url, metadata, pages, storage_options=s3, max_shard_bytes=limit)
    fs = s3fs.S3FileSystem(**s3)
    listed = sorted(path.rsplit("/", 1)[1] for path in fs.ls(f"{BUCKET}/sharded"))
    assert listed == sorted([Path(f).name for f in info.files] + ["snap.safetensors.index.json"])
    with SnapshotReader(url, storage_options=s3) as reader:  # found through the index
        assert reader.metadata == metadata and reader.verify() == []


def test_corruption_on_s3_is_found(s3: dict[str, Any]) -> None:
    metadata, pages = build(extra_blocks=4, seed=44)
    url = f"s3://{BUCKET}/corrupt/snap.safetensors"
    write_snapshot(url, metadata, pages, storage_options=s3)
    fs = s3fs.S3FileSystem(**s3)
    with SnapshotReader(url, storage_options=s3) as reader:
        _, entry = reader.locate("layers.1.key")
    page = metadata.geometry.canonical_page_size_bytes
    raw = bytearray(fs.cat_file(url))
    raw[entry.begin + 5 * page + 17] ^= 0x40
    fs.pipe_file(url, bytes(raw))
    with SnapshotReader(url, storage_options=s3) as reader:
        problems = reader.verify()
    assert [(p.tensor, p.block) for p in problems] == [("layers.1.key", 5)]
