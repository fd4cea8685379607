"""What the command line says of an encoded snapshot's signature, which is its encoded file's own
(its decoded file is unsigned by design): ``inspect`` (text and ``--json``) and the API name its
algorithm, key id and what it binds, for real captures of the built-in model stored fp8 and
lossless with ``--key-file``, and an fp8 capture without a key; ``convert --compress none
--key-file`` of a signed encoded snapshot checks its signature and writes its unsigned decoded
file, saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsnap import Snapshot
from kvsnap.store.files.keys import load_key_ring
from tests.support.cli_runs import new_key_file, run_kvsnap

PROMPTS = ("-p", "A signed prefix, stored smaller", "-p", "And a second one")
#: What inspect says each encoded file's signature binds.
PAGES_BINDING = (
    "the encoded file's fp8 pages bound by signed BLAKE3 digests, its other tensors by BLAKE3"
)
TENSORS_BINDING = "the encoded file's every stored tensor bound by BLAKE3"


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built-in model's KV of two prompts captured fp8 and lossless signed with ``key``,
    fp8 unsigned, and as it is unsigned (``plain``); a second key, ``other``."""
    folder = tmp_path_factory.mktemp("encoded-signatures")
    found = {"key": new_key_file(folder / "k.key"), "other": new_key_file(folder / "other.key")}
    common = ("--dtype", "bfloat16", "--reproducible", *PROMPTS)
    ways = {
        "signed-fp8": ("--compress", "fp8", "--key-file", str(found["key"])),
        "signed-lossless": ("--compress", "lossless", "--key-file", str(found["key"])),
        "fp8": ("--compress", "fp8"),
        "plain": (),
    }
    for name, options in ways.items():
        found[name] = folder / f"{name}.safetensors"
        run = run_kvsnap("capture", "-o", str(found[name]), *common, *options)
        assert run.returncode == 0, run.stderr
    return found


def _inspected(path: Path) -> dict:
    run = run_kvsnap("inspect", str(path), "--json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize(
    ("name", "algorithm", "binding"),
    [
        ("signed-fp8", "encoded-hmac-sha256-blake3-pages", PAGES_BINDING),
        ("signed-lossless", "encoded-hmac-sha256-blake3", TENSORS_BINDING),
    ],
)
def test_inspect_names_the_encoded_files_own_signature(captures, name, algorithm, binding):
    key_id = load_key_ring([captures["key"]]).signing_key_id
    described = _inspected(captures[name])
    assert described["encoding"]["name"] == name.removeprefix("signed-")
    assert described["signature"] == {
        "algorithm": algorithm,
        "key_ids": [key_id],
        "page_binding": "blake3",
        "binding": binding,
    }
    text = run_kvsnap("inspect", str(captures[name])).stdout
    assert f"{algorithm} by key {key_id[:16]}" in " ".join(text.split())
    assert "unsigned" not in text
    with Snapshot.open(captures[name]) as snap:
        assert snap.signature_algorithm == algorithm
        assert snap.signing_key_ids() == [key_id]
        assert snap.page_binding == "blake3"
        assert snap.metadata.signature is None  # the decoded file's: unsigned by design


def test_inspect_of_an_unsigned_encoded_snapshot_says_unsigned(captures):
    described = _inspected(captures["fp8"])
    assert described["encoding"]["name"] == "fp8"
    assert described["signature"] == {
        "algorithm": None,
        "key_ids": [None],
        "page_binding": None,
        "binding": None,
    }
    text = run_kvsnap("inspect", str(captures["fp8"])).stdout
    assert "unsigned" in text
    with Snapshot.open(captures["fp8"]) as snap:
        assert snap.signature_algorithm is None and snap.signing_key_ids() == [None]
        assert snap.page_binding is None


def _to_none(captures: dict[str, Path], source: str, target: Path, *key: str):
    return run_kvsnap(
        "convert", str(captures[source]), "-o", str(target), "--compress", "none", *key, "--json"
    )


@pytest.mark.parametrize("name", ["signed-fp8", "signed-lossless"])
def test_convert_to_none_with_the_key_checks_it_and_writes_the_unsigned_decoded_file(
    captures, tmp_path, name
):
    checked, unchecked = tmp_path / "checked.safetensors", tmp_path / "unchecked.safetensors"
    run = _to_none(captures, name, checked, "--key-file", str(captures["key"]))
    assert run.returncode == 0, run.stderr
    *first, note = json.loads(run.stdout)["notes"]
    assert note.startswith(f"{checked} is unsigned") and "--compress lossless --key-file" in note
    if name == "signed-fp8":  # and its decoded values come without the error it recorded
        (carried,) = first
        assert carried.startswith(f"{captures[name]} is fp8: {checked} holds its decoded file")
        assert carried.endswith("is not carried")
    else:
        assert first == []
    stderr_lines = run.stderr.strip().splitlines()
    assert len(stderr_lines) == 1 + len(first)
    assert all(line.startswith("note: ") for line in stderr_lines)
    # The same file as without the key (which checks nothing): the decoded snapshot.
    assert _to_none(captures, name, unchecked).returncode == 0
    assert checked.read_bytes() == unchecked.read_bytes()
    if name == "signed-lossless":  # bit-exact: the unsigned capture of the same KV
        assert checked.read_bytes() == captures["plain"].read_bytes()
    assert _inspected(checked)["signature"]["algorithm"] is None
    assert _inspected(checked)["encoding"] == {"name": "none"}


def test_convert_to_none_with_another_key_writes_nothing(captures, tmp_path):
    run = _to_none(
        captures, "signed-fp8", tmp_path / "out.safetensors", "--key-file", str(captures["other"])
    )
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert "not one of ours" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["fp8", "plain"])
def test_convert_to_none_of_an_unsigned_snapshot_with_a_key_says_there_is_nothing_to_check(
    captures, tmp_path, name
):
    run = _to_none(captures, name, tmp_path / "out.safetensors", "--key-file", str(captures["key"]))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert f"{captures[name]} is not signed" in line and "capture --key-file" in line
    assert list(tmp_path.iterdir()) == []
