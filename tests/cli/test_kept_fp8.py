"""``kvsnap convert --compress fp8`` of a snapshot that is fp8 already: the file is kept, not
quantized a second time, and the command says so. Text: the usual ``wrote`` line, the recorded
error (not a new one), one note; ``--json``: the same numbers, the recorded report's worst
values, the note. Signed with or without ``--key-file``: the same file; another key: one line,
exit 1, nothing written; unsigned with ``--key-file``: its same tensors signed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvsnap.encoded.read import read_encoded
from kvsnap.encoded.summary import error_line
from kvsnap.encoded.write import encode_file
from kvsnap.store.files.keys import load_key_ring
from tests.support.cli_runs import new_key_file, run_kvsnap
from tests.support.encoded_files import capture_real

WHY = "(quantizing its decoded pages again would round them a second time)"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kept-fp8-cli")
    found = {"key": new_key_file(folder / "k.key"), "other": new_key_file(folder / "other.key")}
    found["plain"] = folder / "kv.safetensors"
    capture_real(found["plain"], "vllm-nhd", torch.bfloat16)
    found["fp8"] = folder / "fp8.safetensors"
    encode_file(found["plain"], found["fp8"], "fp8")
    found["signed-fp8"] = folder / "signed-fp8.safetensors"
    encode_file(found["plain"], found["signed-fp8"], "fp8", keys=load_key_ring(found["key"]))
    return found


def _convert(source: Path, target: Path, *options: str):
    return run_kvsnap("convert", str(source), "-o", str(target), "--compress", "fp8", *options)


def test_text_says_the_file_is_kept_with_its_recorded_error(files, tmp_path):
    source, target = files["fp8"], tmp_path / "again.safetensors"
    run = _convert(source, target)
    assert run.returncode == 0, run.stderr
    assert target.read_bytes() == source.read_bytes()
    recorded = read_encoded(source)
    size, decoded = source.stat().st_size, recorded.decoded_bytes
    wrote, error = run.stdout.strip().splitlines()
    assert wrote.startswith(
        f"wrote {target}: fp8, {size} bytes for {decoded} ({decoded / size:.2f}x smaller) in "
    )
    assert recorded.error is not None and error == f"error: {error_line(recorded.error.worst)}"
    assert run.stderr.splitlines() == [
        f"note: {source} is fp8 already: {target} is a copy of it: its values, scales and "
        f"recorded error unchanged {WHY}"
    ]


def test_json_gives_the_recorded_report_and_the_note(files, tmp_path):
    source, target = files["fp8"], tmp_path / "again.safetensors"
    run = _convert(source, target, "--json")
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    recorded = read_encoded(source)
    assert recorded.error is not None
    assert payload["error"] == recorded.error.worst
    assert (payload["encoding"], payload["path"]) == ("fp8", str(target))
    assert (payload["stored_bytes"], payload["decoded_bytes"]) == (
        source.stat().st_size,
        recorded.decoded_bytes,
    )
    (note,) = payload["notes"]
    assert note.startswith(f"{source} is fp8 already: {target} is a copy of it") and WHY in note
    assert target.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("with_key", [False, True])
def test_a_signed_fp8_snapshot_is_copied_signed(files, tmp_path, with_key):
    source, target = files["signed-fp8"], tmp_path / "again.safetensors"
    options = ("--key-file", str(files["key"])) if with_key else ()
    run = _convert(source, target, *options, "--json")
    assert run.returncode == 0, run.stderr
    (note,) = json.loads(run.stdout)["notes"]
    assert "is a copy of it, signed as it was:" in note
    assert target.read_bytes() == source.read_bytes()


def test_a_signed_fp8_snapshot_under_another_key_is_one_line_and_nothing_written(files, tmp_path):
    run = _convert(
        files["signed-fp8"], tmp_path / "out.safetensors", "--key-file", str(files["other"])
    )
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"error: {files['signed-fp8']}: bad signature")
    assert list(tmp_path.iterdir()) == []


def test_an_unsigned_fp8_snapshot_with_a_key_is_signed_around_the_same_tensors(files, tmp_path):
    target = tmp_path / "signed.safetensors"
    run = _convert(files["fp8"], target, "--key-file", str(files["key"]))
    assert run.returncode == 0, run.stderr
    key_id = load_key_ring(files["key"]).signing_key_id
    assert run.stderr.splitlines() == [
        f"note: {files['fp8']} is fp8 already: {target} holds its values, scales and recorded "
        f"error unchanged, signed with key {key_id} {WHY}"
    ]
    assert target.read_bytes() == files["signed-fp8"].read_bytes()
    inspected = json.loads(run_kvsnap("inspect", str(target), "--json").stdout)
    assert inspected["signature"]["key_ids"] == [key_id]
