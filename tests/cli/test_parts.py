"""The CLI on a parted snapshot of the built-in model: inspect, verify and restore treat it as
one snapshot; a damaged part is named with its tensor and block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsnap.cli.app import app
from kvsnap.layout import torch_dtype
from kvsnap.pipeline import SequenceBlocks
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import SnapshotReader
from kvsnap.testing.caches import KVContent, make_cache

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout


def run_json(*args: str) -> tuple[int, dict]:
    code, out = run(*args, "--json")
    return code, json.loads(out)


def _parted_copy(plain: Path, parted: Path) -> None:
    """``plain``'s KV, put into TP=2 vLLM caches and captured as a parted snapshot."""
    with Snapshot.open(plain) as snap:
        geometry = snap.geometry
        content = KVContent(
            geometry, {name: snap.read_tensor(name) for name in geometry.tensor_names()}
        )
        ranks = [
            make_cache(
                "vllm-nhd",
                num_layers=geometry.num_layers,
                num_blocks=snap.num_blocks,
                block_size=geometry.block_size,
                num_kv_heads=geometry.num_kv_heads,
                head_dim=geometry.head_dim,
                dtype=torch_dtype(geometry.dtype),
                tp_rank=rank,
                tp_size=2,
                attention_types=geometry.attention_types,
            )
            for rank in range(2)
        ]
        for rank in ranks:
            rank.fill(content)
        sequences = [
            SequenceBlocks(record.id, record.token_ids, record.block_ids)
            for record in snap.sequences
        ]
        capture(
            [rank.layout for rank in ranks],
            sequences,
            parted,
            source=snap.metadata.source,
            per_rank_parts=True,
        )


@pytest.fixture(scope="module")
def parted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("parted-cli")
    plain = directory / "plain.safetensors"
    code, _ = run_json("capture", "-o", str(plain), "-p", "The KV cache of a prompt", "-p", "Two")
    assert code == 0
    path = directory / "parted.safetensors"
    _parted_copy(plain, path)
    code, payload = run_json("verify", str(path), "--against", str(plain))
    assert code == 0 and payload["ok"], payload
    return path


def _part_files(path: Path) -> list[str]:
    with Snapshot.open(path) as snap:
        return snap.part_files()


def test_inspect_shows_the_parts(parted: Path) -> None:
    code, payload = run_json("inspect", str(parted))
    assert code == 0 and payload["format_version"] == 2
    assert payload["layout"]["num_kv_heads"] == 2 and payload["layout"]["tp_size"] == 2
    assert [(p["first_head"], p["num_heads"]) for p in payload["parts"]] == [(0, 1), (1, 1)]
    assert [p["file"] for p in payload["parts"]] == _part_files(parted)
    code, out = run("inspect", str(parted) + ".index.json")
    assert code == 0 and "2 KV heads x 32" in out
    assert "part 1" in out and "heads 0..1" in out and "part-00002-of-00002" in out


def test_inspect_of_one_part_says_which_heads_it_holds(parted: Path) -> None:
    part = _part_files(parted)[1]
    code, out = run("inspect", part)
    assert code == 0 and "part 2 of 2 (heads 1..2 of 2)" in out and "1 KV heads x 32" in out
    code, payload = run_json("inspect", part)
    assert payload["part"] == {
        "index": 2,
        "count": 2,
        "first_head": 1,
        "num_heads": 1,
        "num_kv_heads": 2,
    }


def test_verify_and_restore_treat_the_parts_as_one_snapshot(parted: Path) -> None:
    code, payload = run_json("verify", str(parted))
    assert code == 0 and payload == {"ok": True, "problems": []}
    code, payload = run_json("restore", str(parted), "--max-new-tokens", "6", "--check")
    assert code == 0 and payload["check"] == "match" and payload["sequences"] == 2


def test_a_flipped_byte_in_part_2_is_named_with_its_tensor_and_block(
    parted: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "parted.safetensors"
    shutil.copy(str(parted) + ".index.json", str(copy) + ".index.json")
    for part in _part_files(parted):
        shutil.copy(part, tmp_path)
    damaged = Path(_part_files(copy)[1])
    with SnapshotReader(damaged) as reader:
        _, entry = reader.locate("layers.2.value")
        page = reader.page_size_bytes("layers.2.value")
    with damaged.open("r+b") as file:
        file.seek(entry.begin + 1 * page + 100)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x10]))
    code, payload = run_json("verify", str(copy))
    assert code == 1 and not payload["ok"]
    [problem] = payload["problems"]
    assert problem["tensor"] == "layers.2.value" and problem["block"] == 1
    assert damaged.name in problem["message"]
    code, out = run("verify", str(copy))
    assert code == 1 and "FAILED" in out and "layers.2.value" in out and "block 1" in out


def test_a_missing_part_fails_verification_and_inspect_names_it(
    parted: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "parted.safetensors"
    shutil.copy(str(parted) + ".index.json", str(copy) + ".index.json")
    shutil.copy(_part_files(parted)[0], tmp_path)  # part 2 is lost
    missing = Path(_part_files(parted)[1]).name
    code, payload = run_json("verify", str(copy))
    assert code == 1 and not payload["ok"]  # a damaged snapshot, not a bad path (exit 2)
    [problem] = payload["problems"]
    assert missing in problem["message"] and "the index names this file" in problem["message"]
    result = runner.invoke(app, ["inspect", str(copy)])
    assert result.exit_code == 1 and missing in result.stderr
