"""An fp8 file written while it is encoded (kvsnap/encoded/streamed.py): the header keeps room
for the error report at its widest, so the layout planned before encoding is the one the
measured report gets; a streamed file that cannot be written says so, leaves nothing behind
and never touches the previous file; the writer's digests are the trailer's."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

import kvsnap
from kvsnap.encoded.original import parse_original, read_local
from kvsnap.encoded.streamed import StreamedFile, planned_fp8_layout
from kvsnap.encoded.write import encoded_document
from kvsnap.encoding.report import AttentionError, ErrorReport, TensorError
from kvsnap.format import encoded as enc
from kvsnap.format.hashing import digest128
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import real_caches, real_sequences
from tests.support.encoded_tamper import stored_parts, write_parts

KEY = KeyRing([bytes(range(32))])
ROOT = Path(__file__).resolve().parents[2]


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


def test_a_file_written_before_the_header_kept_room_still_reads(tmp_path, monkeypatch):
    # Before 2026-12-06 an encoded header was padded to a multiple of 64 only, whatever its
    # report: the same file laid out that way (its tensors nearer the header) opens, decodes
    # to the same snapshot and verifies.
    (cache,) = real_caches("vllm-nhd", torch.bfloat16)
    current = tmp_path / "fp8.safetensors"
    kvsnap.capture(cache.layout, real_sequences(), current, reproducible=True, compression="fp8")
    with monkeypatch.context() as older:
        older.setattr(enc, "_reserved_header_text", lambda entries, document, length: length)
        old = write_parts(stored_parts(current), tmp_path / "old.safetensors")
    lengths = [enc.header_length(p.read_bytes()[:8], p.stat().st_size) for p in (old, current)]
    assert lengths[0] < lengths[1] and (8 + lengths[0]) % enc.ALIGNMENT == 0
    with kvsnap.Snapshot.open(old) as before, kvsnap.Snapshot.open(current) as now:
        assert (
            before.verify() == [] and before.encoded.error.to_dict() == now.encoded.error.to_dict()
        )
        for name in now.geometry.tensor_names():
            assert torch.equal(
                before.read_tensor(name).view(torch.int16), now.read_tensor(name).view(torch.int16)
            )


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


#: Code run in a child process first: ``limit(nbytes)`` caps the size of the files it writes
#: (writes past it fail with EFBIG instead of a signal), a full disk without filling one. In a
#: child, so the cap never meets the test runner's own output, which may be a file.
_LIMIT = """
import resource, signal, sys
def limit(nbytes):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
"""


def _child(code: str, *args: str) -> str:
    """Run ``code`` after :data:`_LIMIT` in a fresh interpreter with ``args``; its stdout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _LIMIT + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_write_that_fails_midway_says_so_and_leaves_the_previous_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"the previous file")
    said = _child(
        """
        import torch
        from kvsnap.encoded.streamed import StreamedFile
        from kvsnap.errors import SnapshotIOError
        streamed = StreamedFile(sys.argv[1], 1 << 20)
        limit(4096)
        try:
            with streamed:
                streamed.stream("values", torch.zeros(1 << 16, dtype=torch.uint8), 8192)
                streamed.finish([(0, b"head")])
        except SnapshotIOError as error:
            print("refused:", error)
        """,
        str(target),
    )
    assert said.startswith("refused:") and "out.bin" in said and "File too large" in said
    assert sorted(tmp_path.iterdir()) == [target]
    assert target.read_bytes() == b"the previous file"


def test_an_fp8_capture_that_cannot_be_written_is_one_error_and_nothing_else(tmp_path):
    path = tmp_path / "kv.safetensors"
    path.write_bytes(b"the previous snapshot")
    said = _child(
        """
        import kvsnap, torch
        from kvsnap.errors import SnapshotIOError
        from tests.support.encoded_files import real_caches, real_sequences
        (cache,) = real_caches("vllm-nhd", torch.bfloat16)
        limit(1 << 16)
        try:
            kvsnap.capture(cache.layout, real_sequences(), sys.argv[1], compression="fp8")
        except SnapshotIOError as error:
            print("refused:", error)
        """,
        str(path),
    )
    assert said.startswith("refused:") and "kv.safetensors" in said
    assert sorted(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"the previous snapshot"
