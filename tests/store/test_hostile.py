"""Hostile inputs and crashes (issue 15): nothing hangs, nothing leaks file contents, nothing
deletes what it does not own, concurrent readers never see a half-replaced snapshot."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.errors import (
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.snapshot import Snapshot
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.files import publish
from tests.support.cli_runs import run_kvsnap
from tests.support.format_versions import UNKNOWN_FORMAT_VERSION
from tests.support.store_helpers import (
    GEOMETRIES,
    make_metadata,
    random_pages,
    shared_prefix_tokens,
    write_snapshot,
)

ROOT = Path(__file__).resolve().parents[2]


def build(seed: int, name: str = "bf16") -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    geometry = GEOMETRIES[name]
    metadata = make_metadata(geometry, shared_prefix_tokens(rng, geometry.block_size))
    return metadata, random_pages(rng, metadata)


def shard_limit(pages: dict[str, np.ndarray]) -> int:
    """A shard size that gives one layer tensor per shard."""
    return max(p.nbytes for p in pages.values()) + 100


def kv_bytes(path: Path | str) -> dict[str, bytes]:
    with SnapshotReader(path) as reader:
        return {
            name: reader.read_tensor(name).view(torch.uint8).numpy().tobytes()
            for name in reader.metadata.geometry.tensor_names()
        }


def as_bytes(pages: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {name: data.tobytes() for name, data in pages.items()}


def temp_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if publish.TEMP_MARKER in name)


# --------------------------------------------------------------------------------------------
# 1. Named pipes and other non-regular files never block


_OPEN_IN_CHILD = """
import sys
from kvsnap.errors import NotASnapshotError
from kvsnap.store import SnapshotReader
try:
    SnapshotReader(sys.argv[1])
except NotASnapshotError as error:
    print(error)
    sys.exit(3)
"""


@pytest.mark.parametrize("name", ["p.safetensors", "p.safetensors.index.json"])
def test_a_named_pipe_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    # A blocking open of a FIFO waits for a writer forever: run it where a hang can be killed.
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_IN_CHILD, str(fifo)],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "not a regular file" in result.stdout and str(fifo) in result.stdout


@pytest.mark.parametrize("command", [["verify"], ["inspect"], ["inspect", "--json"]])
def test_the_cli_refuses_a_named_pipe_without_blocking(tmp_path: Path, command: list[str]) -> None:
    fifo = tmp_path / "p.safetensors"
    os.mkfifo(fifo)
    kvsnap = Path(sys.executable).with_name("kvsnap")
    result = subprocess.run(
        [kvsnap, command[0], str(fifo), *command[1:]],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------------
# 3. An overwrite deletes only files of the snapshot's own naming


def test_an_overwrite_never_deletes_another_snapshots_shards(tmp_path: Path) -> None:
    metadata, pages = build(31)
    limit = shard_limit(pages)
    other = write_snapshot(tmp_path / "b.safetensors", metadata, pages, max_shard_bytes=limit)
    # a's index is a copy of b's: it names b's shards, which are not a's to delete.
    (tmp_path / "a.safetensors.index.json").write_bytes(Path(other.path).read_bytes())
    write_snapshot(tmp_path / "a.safetensors", metadata, pages)
    assert not (tmp_path / "a.safetensors.index.json").exists()  # a's own index: superseded
    (tmp_path / "a.safetensors").unlink()
    (tmp_path / "a.safetensors.index.json").write_bytes(Path(other.path).read_bytes())
    mine = write_snapshot(tmp_path / "a.safetensors", metadata, pages, max_shard_bytes=limit)
    assert all(Path(file).exists() for file in other.files)
    assert kv_bytes(other.path) == as_bytes(pages)
    # What a's naming does own goes when a is replaced: its previous shards.
    write_snapshot(tmp_path / "a.safetensors", metadata, pages, max_shard_bytes=limit)
    assert not any(Path(file).exists() for file in mine.files)
    assert all(Path(file).exists() for file in other.files)


def test_shard_names_are_owned_only_by_their_stem() -> None:
    assert fmt.is_shard_of("a", "a-00001-of-00002.safetensors")
    assert fmt.is_shard_of("a", fmt.shard_file_name("a", 2, 2, fmt.new_generation()))
    assert fmt.is_shard_of("a[/x]", "a[/x]-00002-of-00002.safetensors")
    for name in (
        "b-00001-of-00002.safetensors",
        "ab-00001-of-00002.safetensors",
        "a-00003-of-00002.safetensors",
        "a-00001-of-00002.safetensors.bak",
        "a.safetensors",
        "a-gXYZ-00001-of-00002.safetensors",
    ):
        assert not fmt.is_shard_of("a", name), name


# --------------------------------------------------------------------------------------------
# 4. Readers of a snapshot being replaced see the old or the new one


def test_readers_see_the_old_or_the_new_snapshot_during_replacements(tmp_path: Path) -> None:
    metadata, first = build(32)
    second = {name: data ^ np.uint8(0x5A) for name, data in first.items()}
    versions = [as_bytes(first), as_bytes(second)]
    limit = shard_limit(first)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, first, max_shard_bytes=limit)
    done = threading.Event()
    failures: list[BaseException] = []

    def replace_repeatedly() -> None:
        try:
            # Sharded to sharded, and through the single-file form and back.
            for round_ in range(25):
                pages = second if round_ % 2 == 0 else first
                shards = None if round_ % 6 == 5 else limit
                write_snapshot(path, metadata, pages, max_shard_bytes=shards)
                time.sleep(0.05)  # one replacement at most during one open attempt
        except BaseException as error:
            failures.append(error)
        finally:
            done.set()

    writer = threading.Thread(target=replace_repeatedly)
    writer.start()
    opens = 0
    errors = []
    while not done.is_set():
        try:
            found = kv_bytes(path)
        except Exception as error:
            errors.append(repr(error))
            continue
        opens += 1
        assert found in versions
    writer.join()
    assert failures == []
    assert errors == [], errors[:3]
    assert opens >= 5
    # Only the last (sharded) snapshot's files remain: no old shard, single file or temporary.
    with SnapshotReader(path) as reader:
        own = {Path(file).name for file in reader.files}
    assert len(own) > 1
    assert set(os.listdir(tmp_path)) == own | {"snap.safetensors.index.json"}


def test_v1_shard_names_without_a_generation_are_still_read(tmp_path: Path) -> None:
    metadata, pages = build(33)
    info = write_snapshot(
        tmp_path / "snap.safetensors", metadata, pages, max_shard_bytes=shard_limit(pages)
    )
    index_text = Path(info.path).read_text()
    count = len(info.files)
    for number, file in enumerate(info.files, start=1):
        old_name = fmt.shard_file_name("snap", number, count)  # the first kvsnap's naming
        os.replace(file, tmp_path / old_name)
        index_text = index_text.replace(Path(file).name, old_name)
    Path(info.path).write_text(index_text)
    assert kv_bytes(info.path) == as_bytes(pages)
    # Replacing it removes the v1 shards: they are this snapshot's by name.
    write_snapshot(tmp_path / "snap.safetensors", metadata, pages)
    assert sorted(os.listdir(tmp_path)) == ["snap.safetensors"]


# --------------------------------------------------------------------------------------------
# 5. Temporary files of dead writers are cleaned, those of live writers kept


_WRITE_AND_DIE = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.support.store_crash_child import write_and_maybe_die
write_and_maybe_die(sys.argv[2], "bf16", 7, ("bytes", 1))
"""


def kill_a_writer(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WRITE_AND_DIE, str(ROOT), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


@pytest.mark.parametrize("name", ["snap.safetensors", "s" * 240 + ".safetensors"])
def test_dead_writers_temporary_files_are_removed_live_ones_kept(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    kill_a_writer(path)
    dead = temp_files(tmp_path)
    assert len(dead) == 1 and not path.exists()
    # Another snapshot's leftover is not this snapshot's to clean.
    kill_a_writer(tmp_path / "other.safetensors")
    others = sorted(set(temp_files(tmp_path)) - set(dead))
    metadata, pages = build(34)
    live = SnapshotWriter(path, metadata)  # holds its temporary file, not committed
    try:
        (live_temp,) = sorted(set(temp_files(tmp_path)) - set(dead) - set(others))
        write_snapshot(path, metadata, pages)
        assert temp_files(tmp_path) == sorted([live_temp, *others])
        page = metadata.geometry.canonical_page_size_bytes
        for tensor in live.tensor_order():
            live.write_pages(tensor, pages[tensor][: metadata.num_blocks * page]).result()
        live.commit()  # its temporary file survived the other write's cleanup
    finally:
        live.abort()
    assert temp_files(tmp_path) == others
    assert kv_bytes(path) == as_bytes(pages)


def test_temporary_names_stay_within_the_file_name_limit() -> None:
    for length in (1, 200, 243, 255):
        final = "x" * length
        temp = publish.temp_name(final, owner="snap")
        assert len(temp.encode()) <= publish.MAX_NAME_BYTES
        assert temp.startswith(".") and publish.TEMP_MARKER in temp
    assert publish.temp_name("snap.safetensors").startswith(".snap.safetensors.kvsnap-tmp-")
    long = publish.temp_name("é" * 200, owner="snap")  # cut on a character boundary
    assert len(long.encode()) <= publish.MAX_NAME_BYTES and "~" + publish.owner_tag("snap") in long


def test_publish_bytes_replaces_atomically_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "calibration.json"
    publish.publish_bytes(target, b"old")
    publish.publish_bytes(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["calibration.json"]
    with pytest.raises(OSError):
        publish.publish_bytes(tmp_path / "missing-directory" / "x", b"data")


# --------------------------------------------------------------------------------------------
# 7. A large index is checked in linear time


def test_an_index_of_20000_shards_decodes(tmp_path: Path) -> None:
    geometry = GEOMETRIES["bf16"]
    tokens = [np.array([index], dtype=np.int64) for index in range(10_000)]
    metadata = make_metadata(geometry, tokens)
    specs = fmt.specs_for(metadata)
    names = [fmt.shard_file_name("big", i, len(specs)) for i in range(1, len(specs) + 1)]
    document = {
        "metadata": {
            "total_size": sum(spec.nbytes for spec in specs),
            "kvsnap": metadata.to_json_dict(),
            "kvsnap.shards": {name: "0" * 32 for name in names},
        },
        "weight_map": {spec.name: name for spec, name in zip(specs, names, strict=True)},
    }
    assert len(names) > 20_000
    index = fmt.decode_index(json.dumps(document).encode())
    assert index.files == tuple(names)
    assert index.weight_map[specs[-1].name] == names[-1]


# --------------------------------------------------------------------------------------------
# 8. Headers are bounded by what their metadata allows, before they are parsed


def _bloated_header(entries: int) -> tuple[bytes, int]:
    """A valid snapshot's header with ``entries`` extra zero-size tensors added."""
    metadata, _ = build(35)
    (layout,) = fmt.file_layouts(metadata)
    body = layout.header[8:].rstrip(b" ")
    extra = b"".join(
        b',"x%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % index
        for index in range(entries)
    )
    bloated = body[:-1] + extra + b"}"
    bloated += b" " * (-(8 + len(bloated)) % fmt.DATA_ALIGNMENT)
    return struct.pack("<Q", len(bloated)) + bloated, layout.file_size - layout.data_start


def test_a_header_with_far_more_entries_than_its_metadata_is_refused_early() -> None:
    header, data_size = _bloated_header(300_000)  # about 20 MB
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(SnapshotCorruptError, match="metadata allows at most"):
            fmt.decode_header(header, len(header) + data_size, file="bloated")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Parsing it whole would build 300,000 objects (several times the header in memory).
    assert peak < len(header) // 4, (peak, len(header))
    assert time.perf_counter() - started < 30


def test_a_bloated_header_file_is_refused_by_the_reader(tmp_path: Path) -> None:
    header, data_size = _bloated_header(20_000)
    path = tmp_path / "bloated.safetensors"
    with open(path, "wb") as file:
        file.write(header)
        file.truncate(len(header) + data_size)
    with pytest.raises(SnapshotCorruptError, match="metadata allows at most"):
        SnapshotReader(path)


def test_a_large_foreign_header_is_not_parsed(tmp_path: Path) -> None:
    entries = b",".join(
        b'"w%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % index for index in range(40_000)
    )
    body = b"{" + entries + b"}"
    header = struct.pack("<Q", len(body)) + body
    with pytest.raises(NotASnapshotError, match="does not begin with kvsnap metadata"):
        fmt.decode_header(header, len(header))


# --------------------------------------------------------------------------------------------
# 10. A damaged format version is corruption; a newer intact one asks for an upgrade


def _with_version(data: bytes, version: bytes, *, fix_trailer: bool) -> bytes:
    """``data`` with its format version 1 written as ``version`` (digits beyond the first take
    the place of the header's padding spaces: the layout does not move)."""
    (length,) = struct.unpack("<Q", data[:8])
    marker = b'\\"format_version\\":1'
    at = data.index(marker, 8, 8 + length) + len(marker) - 1
    header = data[:at] + version + data[at + 1 : 8 + length]
    unpadded = header.rstrip(b" ")
    assert len(unpadded) <= 8 + length, "no padding left for the version's digits"
    changed = bytearray(unpadded.ljust(8 + length) + data[8 + length :])
    if fix_trailer:
        header = bytes(changed[: 8 + length])
        begin, end = fmt.locate_trailer(header)  # type: ignore[misc]
        rows = fmt.decode_trailer(bytes(changed[begin:end]))
        changed[begin:end] = fmt.encode_trailer([fmt.digest128(header), *rows[1:]])
    return bytes(changed)


def test_a_flipped_bit_in_the_format_version_is_reported_as_corruption(tmp_path: Path) -> None:
    metadata, pages = build(36)
    path = tmp_path / "snap.safetensors"
    write_snapshot(path, metadata, pages)
    original = path.read_bytes()
    flipped = tmp_path / "flipped.safetensors"
    for version in (b"3", b"0", b"5", b"9"):  # "1" with one or two bits flipped
        flipped.write_bytes(_with_version(original, version, fix_trailer=False))
        with pytest.raises(SnapshotCorruptError, match="damaged header") as caught:
            SnapshotReader(flipped)
        assert str(flipped) in str(caught.value)
    newer = tmp_path / "newer.safetensors"
    unknown = str(UNKNOWN_FORMAT_VERSION).encode()
    newer.write_bytes(_with_version(original, unknown, fix_trailer=True))
    with pytest.raises(UnsupportedVersionError, match="upgrade kvsnap"):
        SnapshotReader(newer)
    with pytest.raises(UnsupportedVersionError, match="upgrade kvsnap") as caught:
        Snapshot.open(newer)  # not taken for an encoded snapshot (version 3)
    # It names every version this kvsnap reads: encoded files' 3 too.
    assert f"format version {UNKNOWN_FORMAT_VERSION} " in str(caught.value)
    assert "reads (1, 2 for parted snapshots, 3 for encoded ones)" in str(caught.value)
    run = run_kvsnap("inspect", str(newer))
    assert run.returncode == 2, run.stderr  # the file is intact: the user upgrades
    (line,) = run.stderr.strip().splitlines()
    assert "3 for encoded ones" in line and line.endswith("upgrade kvsnap")


# --------------------------------------------------------------------------------------------
# 11. Shard names, long names, symbolic links, the sharded snapshot's .safetensors name


def test_nul_bytes_in_shard_names_are_a_clean_error(tmp_path: Path) -> None:
    metadata, pages = build(37)
    info = write_snapshot(
        tmp_path / "snap.safetensors", metadata, pages, max_shard_bytes=shard_limit(pages)
    )
    index = Path(info.path)
    original = index.read_text()
    # Every shard renamed alike (one stem, the right suffixes): only the NUL is wrong.
    for bad_stem in ("sn\\u0000ap", "\\u0000snap", "sn\\nap"):
        index.write_text(original.replace('"snap-', f'"{bad_stem}-'))
        with pytest.raises(SnapshotCorruptError, match="shard 1 is named"):
            SnapshotReader(index)
    with pytest.raises(SnapshotIOError, match="NUL"):
        SnapshotReader(str(tmp_path / "sn\u0000ap.safetensors"))


def test_file_names_of_240_bytes_and_more_are_written(tmp_path: Path) -> None:
    metadata, pages = build(38)
    for length in (240, 243):  # 243 + ".safetensors" = 255 bytes, the limit
        path = tmp_path / ("n" * length + ".safetensors")
        write_snapshot(path, metadata, pages)
        assert kv_bytes(path) == as_bytes(pages)
    assert temp_files(tmp_path) == []


def test_a_symlinked_shard_outside_the_directory_is_refused_silently(tmp_path: Path) -> None:
    metadata, pages = build(39)
    snapshot_dir, elsewhere = tmp_path / "snap", tmp_path / "elsewhere"
    snapshot_dir.mkdir()
    elsewhere.mkdir()
    info = write_snapshot(
        snapshot_dir / "snap.safetensors", metadata, pages, max_shard_bytes=shard_limit(pages)
    )
    secret = elsewhere / "secret"
    secret.write_bytes(b"SECRETS!" + b"x" * 100)
    shard = Path(info.files[1])
    saved = shard.read_bytes()
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(SnapshotCorruptError, match="outside the snapshot's directory") as caught:
        SnapshotReader(info.path)
    leaked = str(int.from_bytes(b"SECRETS!", "little"))
    assert "SECRETS" not in str(caught.value) and leaked not in str(caught.value)
    # A symbolic link that stays within the directory is followed as before.
    shard.unlink()
    (snapshot_dir / "kept-here").write_bytes(saved)
    shard.symlink_to(snapshot_dir / "kept-here")
    assert kv_bytes(info.path) == as_bytes(pages)


def test_refusing_a_foreign_file_does_not_show_its_first_bytes(tmp_path: Path) -> None:
    path = tmp_path / "private.safetensors"
    path.write_bytes(b"SECRETS!" + b"y" * 100)
    with pytest.raises(NotASnapshotError) as caught:
        SnapshotReader(path)
    assert str(int.from_bytes(b"SECRETS!", "little")) not in str(caught.value)


# --------------------------------------------------------------------------------------------
# Markup-bearing ids and paths are text: they round-trip unchanged


@pytest.mark.parametrize("shards", [False, True])
def test_markup_in_ids_and_paths_round_trips_unchanged(tmp_path: Path, shards: bool) -> None:
    geometry = GEOMETRIES["bf16"]
    rng = np.random.default_rng(40)
    metadata = make_metadata(geometry, shared_prefix_tokens(rng, geometry.block_size, 4))
    ids = ["seq[/]", "user[admin]", "[bold]x[/bold]", "a[/x]\\[y]"]
    for record, new_id in zip(metadata.sequences, ids, strict=False):
        record.id = new_id
    metadata.source = fmt.SourceInfo(
        engine="[red]engine[/red]", engine_version="1[/]", model_id="m[/i]", model_revision="[x]"
    )
    pages = random_pages(rng, metadata)
    directory = tmp_path / "a[" / "x]"
    directory.mkdir(parents=True)
    path = directory / "snap[v2].safetensors"
    options: dict[str, Any] = {"max_shard_bytes": shard_limit(pages)} if shards else {}
    info = write_snapshot(path, metadata, pages, **options)
    with SnapshotReader(path) as reader:
        assert reader.metadata == metadata
        assert [record.id for record in reader.metadata.sequences][:4] == ids
        assert reader.metadata.source.model_id == "m[/i]"
        assert reader.files == list(info.files)
        assert all(str(directory) in file for file in reader.files)
        assert reader.verify() == []
    data = bytearray(Path(info.files[-1]).read_bytes())
    data[-1] ^= 1  # the trailer's own digest
    Path(info.files[-1]).write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError) as caught:
        SnapshotReader(path)
    assert caught.value.file == info.files[-1] and str(caught.value).startswith(info.files[-1])
