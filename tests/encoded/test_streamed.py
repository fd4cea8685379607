"""An fp8 file written while it is encoded (kvsnap/encoded/streamed.py): the header keeps room
for the error report at its widest, so the layout planned before encoding is the one the
measured report gets; a streamed file that cannot be written says so, leaves nothing behind
and never touches the previous file; the writer's digests are the trailer's."""

from __future__ import annotations

import random
import resource
import signal

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.original import parse_original, read_local
from kvsnap.encoded.streamed import StreamedFile, planned_fp8_layout
from kvsnap.encoded.write import encoded_document
from kvsnap.encoding.report import AttentionError, ErrorReport, TensorError
from kvsnap.errors import SnapshotIOError
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import digest128
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import real_caches, real_sequences

KEY = KeyRing([bytes(range(32))])


def _report(numbers: random.Random | None) -> ErrorReport:
    """A report of two layers' key and value: every number from ``numbers`` (floats over every
    magnitude, rounded as the metadata stores them; ints up to 2**63), or at its widest."""

    def real() -> float:
        if numbers is None:
            return enc.WIDEST_REPORT_FLOAT
        return numbers.choice([-1, 1]) * numbers.random() * 10.0 ** numbers.randint(-320, 308)

    def count() -> int:
        return enc.WIDEST_REPORT_INT if numbers is None else numbers.randint(0, 2**63 - 1)

    tensors = tuple(
        TensorError(f"layers.{layer}.{part}", count(), *(real() for _ in range(6)), count())
        for layer in range(2)
        for part in ("key", "value")
    )
    attention = tuple(AttentionError(layer, count(), real(), real(), real()) for layer in range(2))
    return ErrorReport("fp8-e4m3", "block-head", "keys", tensors, attention)


def _data_start(report: ErrorReport) -> int:
    document = encoded_document("fp8", {}, 1 << 20, None, report)
    header, layout = enc.build_layout(document, [("kvsnap.x", "U8", (3,))])
    assert len(header) == layout.data_start
    return layout.data_start


def test_the_header_keeps_room_for_any_report_of_the_same_tensors():
    widest = _data_start(_report(None))
    generator = random.Random(39)
    starts = {_data_start(_report(generator)) for _ in range(300)}
    assert starts == {widest}
    # Without the room kept, the same header would be shorter.
    document = encoded_document("fp8", {}, 1 << 20, None, _report(None))
    document["encoding"]["error"] = None
    header, _ = enc.build_layout(document, [("kvsnap.x", "U8", (3,))])
    assert len(header) < widest


def test_a_padded_header_reads_back_as_written(tmp_path):
    source = tmp_path / "plain.safetensors"
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    kvsnap.capture(cache.layout, real_sequences(), source, reproducible=True)
    encoded = tmp_path / "fp8.safetensors"
    kvsnap.capture(
        cache.layout, real_sequences(), encoded, reproducible=True, compression="fp8", keys=KEY
    )
    data = encoded.read_bytes()
    length = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + length]
    assert text.endswith(b" ") and len(text) - len(text.rstrip(b" ")) >= enc.ALIGNMENT
    with kvsnap.Snapshot.open(encoded, keys=KEY) as snapshot:
        assert snapshot.encoded is not None
        assert snapshot.metadata.num_blocks > 0
    # The plan made before encoding is the file's layout, tensor for tensor.
    original = parse_original(read_local(source), str(source))
    _, planned = planned_fp8_layout(original.layout, KEY)
    written = enc.parse_header(data[: 8 + length], len(data))
    assert planned.tensors == written.tensors


def test_a_streamed_tensor_and_its_digest(tmp_path):
    target = tmp_path / "out.bin"
    payload = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 3000, dtype=np.uint8))
    with StreamedFile(target, 4096) as streamed:
        streamed.stream("values", payload, 64)
        size = streamed.finish([(0, b"head"), (3064, b"tail")])
    data = target.read_bytes()
    assert size == len(data) == 4096
    assert data[:4] == b"head" and data[3064:3068] == b"tail"
    assert data[64:3064] == payload.numpy().tobytes()
    assert streamed.digests["values"].result() == digest128(payload.numpy())
    assert list(tmp_path.iterdir()) == [target]


@pytest.fixture
def file_size_limit():
    """Set a limit on the size of files this process writes (writes past it fail with EFBIG
    instead of a signal): a full disk without filling one."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, previous[1]))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, previous)
    signal.signal(signal.SIGXFSZ, previous_handler)


def test_a_write_that_fails_midway_says_so_and_leaves_the_previous_file(tmp_path, file_size_limit):
    target = tmp_path / "out.bin"
    target.write_bytes(b"the previous file")
    streamed = StreamedFile(target, 1 << 20)
    file_size_limit(4096)
    with streamed, pytest.raises(SnapshotIOError, match=r"out\.bin"):
        streamed.stream("values", torch.zeros(1 << 16, dtype=torch.uint8), 8192)
        streamed.finish([(0, b"head")])
    assert sorted(tmp_path.iterdir()) == [target]
    assert target.read_bytes() == b"the previous file"


def test_an_fp8_capture_that_cannot_be_written_is_one_error_and_nothing_else(
    tmp_path, file_size_limit
):
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    path = tmp_path / "kv.safetensors"
    path.write_bytes(b"the previous snapshot")
    file_size_limit(1 << 16)
    with pytest.raises(SnapshotIOError, match=r"kv\.safetensors"):
        kvsnap.capture(cache.layout, real_sequences(), path, compression="fp8")
    assert sorted(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"the previous snapshot"
