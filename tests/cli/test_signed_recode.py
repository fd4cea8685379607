"""``kvsnap convert --compress lossless|fp8`` of a signed capture: the encoded file holds the
unsigned file the capture stands for (the same bytes as the encode of an unsigned capture of the
same KV) and is signed with the key given, which checks the capture's signature first; without
the key, or with another one, nothing is written and one line says why. ``verify`` with another
key names the encoded file's bad signature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsnap import Snapshot
from kvsnap.store.files.keys import load_key_ring
from kvsnap.testing.caches import same_bytes
from tests.support.cli_runs import new_key_file, run_kvsnap

PROMPTS = ("-p", "A signed prefix, stored smaller", "-p", "And a second one")


def _json(*args: str) -> tuple[int, dict]:
    run = run_kvsnap(*args, "--json")
    return run.returncode, json.loads(run.stdout)


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built-in model's KV of two prompts captured signed (key ``key``) and unsigned, and
    a second key (``other``)."""
    folder = tmp_path_factory.mktemp("signed-recode")
    found = {"key": new_key_file(folder / "k.key"), "other": new_key_file(folder / "other.key")}
    found["signed"], found["plain"] = folder / "signed.safetensors", folder / "plain.safetensors"
    common = ("--dtype", "bfloat16", "--reproducible", *PROMPTS)
    assert (
        run_kvsnap(
            "capture", "-o", str(found["signed"]), *common, "--key-file", str(found["key"])
        ).returncode
        == 0
    )
    assert run_kvsnap("capture", "-o", str(found["plain"]), *common).returncode == 0
    return found


def _convert(
    captures: dict[str, Path], source: str, target: Path, compression: str, key: str | None
):
    keys = () if key is None else ("--key-file", str(captures[key]))
    return run_kvsnap(
        "convert", str(captures[source]), "-o", str(target), "--compress", compression, *keys
    )


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_a_signed_capture_encodes_to_a_file_signed_with_its_key(captures, tmp_path, compression):
    encoded, of_plain = tmp_path / "encoded.safetensors", tmp_path / "of-plain.safetensors"
    assert _convert(captures, "signed", encoded, compression, "key").returncode == 0
    # What is encoded is the unsigned file: the same bytes as an unsigned capture encoded.
    assert _convert(captures, "plain", of_plain, compression, "key").returncode == 0
    assert encoded.read_bytes() == of_plain.read_bytes()
    keys = load_key_ring([captures["key"]])
    with Snapshot.open(encoded, keys=keys) as snap, Snapshot.open(captures["signed"]) as source:
        assert snap.encoded.encoding["name"] == compression
        assert snap.encoded.encoding["signature"].startswith("encoded-hmac-sha256-blake3")
        assert snap.metadata.signature is None  # the decoded file
        names = source.geometry.tensor_names()
        exact = [same_bytes(snap.read_tensor(name), source.read_tensor(name)) for name in names]
    code, checked = _json(
        "verify",
        str(encoded),
        "--key-file",
        str(captures["key"]),
        "--against",
        str(captures["signed"]),
    )
    assert code == 0 and checked["ok"] and checked["signature"] == "valid"
    if compression == "lossless":
        assert all(exact)
        layers = checked["comparison"]["layer_errors"]
        assert [layer["max_abs_diff"] for layer in layers] == [0.0] * (len(names) // 2)
    else:
        assert not any(exact)  # fp8 pages, measured again against the capture: as recorded
        assert checked["error"]["measured"] == checked["error"]["recorded"]
        assert 0 < checked["error"]["measured"]["rms_rel"] < 0.05
    code, restored = _json(
        "restore",
        str(encoded),
        "--key-file",
        str(captures["key"]),
        "--check",
        "--max-new-tokens",
        "4",
    )
    assert code == 0 and restored["sequences"] == 2
    if compression == "lossless":
        assert restored["check"] == "match"


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_another_key_does_not_verify_the_encoded_file(captures, tmp_path, compression):
    encoded, unsigned = tmp_path / "encoded.safetensors", tmp_path / "unsigned.safetensors"
    assert _convert(captures, "signed", encoded, compression, "key").returncode == 0
    code, checked = _json("verify", str(encoded), "--key-file", str(captures["other"]))
    assert code == 1 and not checked["ok"] and checked["signature"] == "bad signature"
    (problem,) = checked["problems"]
    assert problem["message"].startswith(f"{encoded}: ") and "not one of ours" in problem["message"]
    # The encoded file is what is signed or not, not the decoded file it stands for.
    assert _convert(captures, "plain", unsigned, compression, None).returncode == 0
    code, checked = _json("verify", str(unsigned), "--key-file", str(captures["key"]))
    assert code == 1 and checked["signature"] == "unsigned"
    assert checked["problems"][0]["message"].startswith(f"{unsigned}: ")


def test_without_the_key_nothing_is_written_and_one_line_says_to_pass_it(captures, tmp_path):
    for compression in ("lossless", "fp8"):
        run = _convert(captures, "signed", tmp_path / "encoded.safetensors", compression, None)
        assert run.returncode == 2
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "is signed" in lines[0] and "--key-file" in lines[0]
        assert list(tmp_path.iterdir()) == []
    # An encoded signed file, encoded again, is refused alike.
    encoded = tmp_path / "encoded.safetensors"
    assert _convert(captures, "signed", encoded, "fp8", "key").returncode == 0
    run = run_kvsnap(
        "convert", str(encoded), "-o", str(tmp_path / "again.safetensors"), "--compress", "lossless"
    )
    assert run.returncode == 2 and "is signed" in run.stderr and "--key-file" in run.stderr
    assert [path.name for path in tmp_path.iterdir()] == [encoded.name]


@pytest.mark.parametrize("compression", ["lossless", "fp8", "none"])
def test_a_key_other_than_the_captures_is_refused_and_nothing_is_written(
    captures, tmp_path, compression
):
    run = _convert(captures, "signed", tmp_path / "out.safetensors", compression, "other")
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad signature" in lines[0] and "not one of ours" in lines[0]
    assert list(tmp_path.iterdir()) == []
    if compression == "none":  # with its own key: the signed file as it is
        assert (
            _convert(captures, "signed", tmp_path / "out.safetensors", "none", "key").returncode
            == 0
        )
        assert (tmp_path / "out.safetensors").read_bytes() == captures["signed"].read_bytes()
