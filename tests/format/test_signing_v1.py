"""Signed snapshots of the older form (``"hmac-sha256"``: pages bound by xxh3-64 only) still
open and read with their key, and say how weakly their pages are bound.

``fixtures/signed-v1/signed.safetensors`` was written by the kvsnap that signed this way
(commit 6fa270e); tests/support/signed_v1.py writes the same form of any content, checked here
against that file byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap import format as fmt
from kvsnap.cli.app import app
from kvsnap.errors import BadSignatureError, SnapshotCorruptError
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from tests.support.signed_v1 import FIXTURE, FIXTURE_KEY, fixture_inputs, write_v1_signed

KEYS = KeyRing([FIXTURE_KEY])


def test_the_older_kvsnaps_signed_file_opens_and_reads_with_its_key() -> None:
    metadata, pages = fixture_inputs()
    with Snapshot.open(FIXTURE, keys=KEYS) as snapshot:
        assert snapshot.metadata.signature == "hmac-sha256"
        assert snapshot.page_binding == "xxh3-64"
        # No BLAKE3 digests to check its pages against: they are checked by their xxh3-64.
        assert snapshot.reader.page_digest_table is None
        assert snapshot.verify() == []
        for name in metadata.geometry.tensor_names():
            read = snapshot.read_tensor(name).contiguous().view(-1).view(torch.uint8).numpy()
            assert read.tobytes() == pages[name].tobytes()
        assert np.array_equal(snapshot.sequences[0].token_ids, metadata.sequences[0].token_ids)
    with pytest.raises(BadSignatureError):
        Snapshot.open(FIXTURE, keys=KeyRing([bytes(range(1, 33))]))


def test_the_helper_writes_the_older_form_byte_for_byte(tmp_path: Path) -> None:
    metadata, pages = fixture_inputs()
    written = tmp_path / "v1.safetensors"
    write_v1_signed(written, metadata, pages, KEYS)
    assert written.read_bytes() == FIXTURE.read_bytes()


def test_an_older_signed_files_pages_are_still_checked_by_xxh3(tmp_path: Path) -> None:
    copy = tmp_path / "damaged.safetensors"
    raw = bytearray(FIXTURE.read_bytes())
    with Snapshot.open(FIXTURE) as snapshot:
        _, entry = snapshot.reader.locate("layers.0.value")
        page_bytes = snapshot.reader.page_bytes
    raw[entry.begin + page_bytes + 3] ^= 0x10  # block 1
    copy.write_bytes(bytes(raw))
    with Snapshot.open(copy, keys=KEYS) as snapshot:  # its trailer is intact: it opens
        problems = snapshot.verify()
        assert [(p.tensor, p.block) for p in problems] == [("layers.0.value", 1)]
        assert "xxh3-64" in problems[0].message
        with pytest.raises(SnapshotCorruptError, match="xxh3-64"):
            snapshot.read_tensor("layers.0.value")


def test_inspect_names_the_weaker_binding() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(FIXTURE), "--json"])
    assert result.exit_code == 0, result.output
    signature = json.loads(result.stdout)["signature"]
    assert signature["algorithm"] == fmt.SIGNATURE_ALGORITHM_V1
    assert signature["page_binding"] == "xxh3-64"
    assert signature["binding"] == "pages bound by xxh3-64 only: not collision-resistant"
    result = runner.invoke(app, ["inspect", str(FIXTURE)], env={"COLUMNS": "240"})
    assert result.exit_code == 0
    assert "pages bound by xxh3-64 only: not collision-resistant" in result.stdout
