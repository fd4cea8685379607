"""The committed encoded fixtures (fixtures/encoded-v3/: format version 3, lossless and fp8
encodings of v1 fixtures, one signed) stay readable and what they were: each opens and verifies
(the signed one with its key only), a lossless one decodes to its v1 source byte for byte, an
fp8 one carries the error measured again against its source, docs/format.md's recipe rebuilds
its decoded file, and encoding the source today gives the same stored tensors and metadata (all
but the writer's version and, on a GPU, the report's last digits: sums in another order)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.summary import measured_error, reports_agree
from kvsnap.encoded.write import encode_file
from kvsnap.errors import BadSignatureError, UnsignedSnapshotError
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from tests.support.format_doc import decoded_file

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MANIFEST = json.loads((FIXTURES / "encoded-v3" / "manifest.json").read_text())
ENTRIES = MANIFEST["fixtures"]
IDS = [entry["file"].removesuffix(".safetensors") for entry in ENTRIES]
#: The key of the signed fixture (scripts/make_fixtures.py ENCODED_FIXTURE_KEY).
KEY = KeyRing([bytes(range(32))])


def _paths(entry: dict[str, Any]) -> tuple[Path, Path]:
    return FIXTURES / "encoded-v3" / entry["file"], FIXTURES / "v1" / entry["source"]


def test_the_encoded_fixtures_are_all_listed_and_cover_both_encodings():
    on_disk = {path.name for path in (FIXTURES / "encoded-v3").glob("*.safetensors")}
    assert on_disk == {entry["file"] for entry in ENTRIES}
    assert MANIFEST["format_version"] == enc.ENCODED_FORMAT_VERSION
    assert {entry["encoding"] for entry in ENTRIES} == set(enc.ENCODINGS)
    assert any(entry["signed"] for entry in ENTRIES)
    assert sum(entry["bytes"] for entry in ENTRIES) < 256 << 10


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_an_encoded_fixture_reads_and_decodes_to_its_source(entry):
    path, source = _paths(entry)
    content = path.read_bytes()
    assert hashlib.sha256(content).hexdigest() == entry["sha256"], f"{path} was modified"
    assert len(content) == entry["bytes"]
    keys = KEY if entry["signed"] else None
    encoded = read_encoded(path, keys)
    assert encoded.layout.document["format_version"] == enc.ENCODED_FORMAT_VERSION
    assert encoded.encoding["name"] == entry["encoding"]
    with Snapshot.open(path, keys=keys) as snapshot:
        assert snapshot.verify() == []
        with Snapshot.open(source) as original:
            assert snapshot.num_blocks == original.num_blocks
            assert [r.id for r in snapshot.sequences] == [r.id for r in original.sequences]
            if entry["encoding"] == "fp8" and encoded.error is not None:
                names = original.geometry.tensor_names()
                again = measured_error(snapshot, original, names, encoded.error.encoding)
                assert reports_agree(again.to_dict(), encoded.error.to_dict())
    decoded = decode(encoded).tobytes()
    assert decoded_file(path) == decoded  # docs/format.md's recipe, without kvsnap
    if entry["encoding"] == "lossless" or encoded.error is None:  # nothing lossy stored
        assert decoded == source.read_bytes()
    if entry["signed"]:
        with pytest.raises(BadSignatureError):
            read_encoded(path, KeyRing([bytes(32)]))
    else:
        with pytest.raises(UnsignedSnapshotError):
            read_encoded(path, KEY)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_encoding_the_source_today_stores_the_same_tensors(tmp_path, entry):
    path, source = _paths(entry)
    fresh = tmp_path / entry["file"]
    encode_file(source, fresh, entry["encoding"], keys=KEY if entry["signed"] else None)
    committed, today = read_encoded(path), read_encoded(fresh)
    documents = [dict(file.layout.document) for file in (committed, today)]
    encodings = [dict(document.pop("encoding")) for document in documents]
    reports = [encoding.pop("error") for encoding in encodings]
    for document in documents:
        document.pop("kvsnap_version")
    assert documents[0] == documents[1] and encodings[0] == encodings[1]
    assert (reports[0] is None) == (reports[1] is None)
    if reports[0] is not None:
        assert reports_agree(reports[1], reports[0])
    # The trailer and the signature cover the header, which names the writer's version.
    covering = {enc.ENCODED_CHECKSUMS_TENSOR, SIGNATURE_TENSOR}
    names = [t.name for t in committed.layout.tensors if t.name not in covering]
    assert names == [t.name for t in today.layout.tensors if t.name not in covering]
    for name in names:
        assert np.array_equal(committed.tensor(name), today.tensor(name)), name
