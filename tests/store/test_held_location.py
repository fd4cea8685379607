"""A ``Location`` over bytes held in memory (an encoded snapshot decoded on the host, opened
under the encoded file's name): it exists for as long as it is held, whatever is on disk under
its name, and removing it is refused, never a deletion of the encoded file its name points at."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.encoded.opening import open_decoded
from kvsnap.encoded.write import encode_file
from kvsnap.snapshot import Snapshot
from kvsnap.store.files.location import Location, locate
from kvsnap.store.read.head_parts import open_held
from tests.support.encoded_files import capture_real


@pytest.fixture(scope="module")
def encoded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lossless file of real KV (the built-in model's prefill, bf16)."""
    folder = tmp_path_factory.mktemp("held-location")
    capture_real(folder / "kv.safetensors", "vllm-nhd", torch.bfloat16)
    encode_file(folder / "kv.safetensors", folder / "kv.lossless.safetensors", "lossless")
    return folder / "kv.lossless.safetensors"


def _decoded(path: Path) -> np.ndarray:
    """The file ``path`` decodes to, in memory (what ``Snapshot.open`` opens it from)."""
    found = open_decoded(path)
    assert found is not None
    return found[0]


def test_a_held_file_exists_while_held_even_when_nothing_on_disk_has_its_name(
    encoded: Path, tmp_path: Path
) -> None:
    decoded = _decoded(encoded)
    gone = str(tmp_path / "moved-away.safetensors")  # the encoded file renamed meanwhile
    held = Location(gone, gone, held=decoded)
    assert held.exists()
    assert not locate(gone, None).exists()  # the same name, not held: nothing there
    with open_held(decoded, gone) as opened, Snapshot.open(encoded) as snapshot:
        assert opened.metadata == snapshot.metadata  # it opens, from the held bytes


def test_removing_a_held_file_is_refused_and_leaves_the_file_of_its_name(
    encoded: Path, tmp_path: Path
) -> None:
    before = encoded.read_bytes()
    encoded = tmp_path / encoded.name
    encoded.write_bytes(before)
    decoded = _decoded(encoded)
    held = Location(str(encoded), str(encoded), held=decoded)
    with pytest.raises(ValueError, match="held in memory") as refused:
        held.remove()
    assert str(encoded) in str(refused.value)
    assert encoded.read_bytes() == before  # the encoded file the name points at, untouched
    assert held.exists()
    plain = locate(encoded, None)  # the file itself, not held, is removed as before
    plain.remove()
    assert not plain.exists() and not encoded.exists()
