"""Hashing: prefix hash chains against their definition, dedupe, page checksums on the host and
on the device equal to python-xxhash's xxh3-64, and the trailer's self-check."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format import hashing
from kvsnap.transfer import page_hash
from tests.support.store_helpers import shared_prefix_tokens

# --------------------------------------------------------------------------------------------
# Prefix hash chains


def test_prefix_hash_chain_follows_its_definition() -> None:
    """Each hash is xxh3-128(previous digest ‖ token count ‖ tokens), all little-endian int64."""
    tokens = np.arange(10, dtype=np.int64) * 7919
    chain = fmt.prefix_hash_chain(tokens, 4)
    previous = bytes(16)
    for index, start in enumerate(range(0, 10, 4)):
        block = tokens[start : start + 4]
        digest = xxhash.xxh3_128_digest(
            previous
            + struct.pack("<q", len(block))
            + struct.pack(f"<{len(block)}q", *block.tolist())
        )
        assert chain[index] == digest.hex()
        previous = digest
    assert len(chain) == 3  # 4 + 4 + a partial block of 2


def test_prefix_hash_chain_follows_its_definition_on_random_sequences() -> None:
    """Random lengths, block sizes (longer than the sequence too) and parents: every chain
    equals the definition's, one incremental hasher per block."""
    rng = np.random.default_rng(26)
    for _ in range(300):
        tokens = rng.integers(-(2**62), 2**62, int(rng.integers(0, 200)))
        block_size = int(rng.choice([1, 3, 16, 32, 250, 2**40]))
        parent = None if rng.random() < 0.5 else rng.bytes(16).hex()
        previous = bytes(16) if parent is None else bytes.fromhex(parent)
        expected = []
        for start in range(0, len(tokens), block_size):
            block = tokens[start : start + block_size]
            hasher = xxhash.xxh3_128()
            hasher.update(previous)
            hasher.update(struct.pack("<q", len(block)))
            hasher.update(block.astype("<i8").tobytes())
            previous = hasher.digest()
            expected.append(previous.hex())
        assert fmt.prefix_hash_chain(tokens, block_size, parent) == expected


def test_prefix_hash_chain_is_a_prefix_identity() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 100_000, 40)
    chain = fmt.prefix_hash_chain(tokens, 8)
    # Same prefix, same hashes; one changed token changes its block and every later one.
    changed = tokens.copy()
    changed[20] += 1
    other = fmt.prefix_hash_chain(changed, 8)
    assert other[:2] == chain[:2]
    assert all(a != b for a, b in zip(other[2:], chain[2:], strict=True))
    # A partial block never equals a full one, nor a partial block of another length.
    assert fmt.prefix_hash_chain(tokens[:12], 8)[1] != fmt.prefix_hash_chain(tokens[:16], 8)[1]
    assert fmt.prefix_hash_chain(tokens[:12], 8)[1] != fmt.prefix_hash_chain(tokens[:13], 8)[1]
    # Continuing from a parent equals hashing the whole sequence.
    assert fmt.prefix_hash_chain(tokens[16:], 8, parent=chain[1]) == chain[2:]
    # The integer type of the input does not matter, only the values.
    assert fmt.prefix_hash_chain(tokens.astype(np.int32), 8) == chain
    assert fmt.prefix_hash_chain(tokens.tolist(), 8) == chain
    assert fmt.prefix_hash_chain([], 8) == []


def test_prefix_hash_chain_is_the_same_in_another_process() -> None:
    """No salted hash(): a fresh interpreter with another hash seed gets the same chain."""
    tokens = list(range(100, 137))
    code = (
        "import json; from kvsnap.format import prefix_hash_chain; "
        f"print(json.dumps(prefix_hash_chain({tokens}, 16)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert json.loads(result.stdout) == fmt.prefix_hash_chain(tokens, 16)


def test_prefix_hash_chain_rejects_bad_input() -> None:
    with pytest.raises(TypeError):
        fmt.prefix_hash_chain(np.array([1.5, 2.0]), 4)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain(np.zeros((2, 2), dtype=np.int64), 4)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain([1, 2], 0)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain([1, 2], 4, parent="not-hex")


# --------------------------------------------------------------------------------------------
# Dedupe


def test_dedupe_blocks_stores_each_prefix_once() -> None:
    rng = np.random.default_rng(2)
    sequences = shared_prefix_tokens(rng, 4, num_sequences=6)
    sequences.append(sequences[0].copy())  # an exact duplicate shares every block
    chains = [fmt.prefix_hash_chain(tokens, 4) for tokens in sequences]
    dedupe = fmt.dedupe_blocks(chains)
    distinct = {digest for chain in chains for digest in chain}
    assert dedupe.num_blocks == len(distinct) < sum(len(chain) for chain in chains)
    for chain, ids in zip(chains, dedupe.sequence_block_ids, strict=True):
        assert ids.dtype == np.int64
        assert [dedupe.block_hashes[i] for i in ids.tolist()] == chain
    np.testing.assert_array_equal(dedupe.sequence_block_ids[-1], dedupe.sequence_block_ids[0])
    # Owners are first occurrences, and blocks are numbered in order of first appearance.
    seen: set[str] = set()
    expected_owners = []
    for sequence_index, chain in enumerate(chains):
        for position, digest in enumerate(chain):
            if digest not in seen:
                seen.add(digest)
                expected_owners.append((sequence_index, position))
    assert dedupe.owners.tolist() == [list(owner) for owner in expected_owners]


def test_dedupe_of_nothing() -> None:
    dedupe = fmt.dedupe_blocks([])
    assert dedupe.num_blocks == 0 and dedupe.owners.shape == (0, 2)


# --------------------------------------------------------------------------------------------
# Page checksums


@pytest.mark.parametrize("page_bytes", [1, 7, 256, 4096, 32768])
def test_block_digests_match_xxhash_on_random_pages(page_bytes):
    data = np.random.default_rng(page_bytes).integers(0, 256, page_bytes * 9, dtype=np.uint8)
    want = [
        xxhash.xxh3_64_intdigest(data[i * page_bytes : (i + 1) * page_bytes].tobytes())
        for i in range(9)
    ]
    assert hashing.block_digests(data, page_bytes).tolist() == want
    assert (
        hashing.block_digests(memoryview(data.tobytes()), page_bytes).tolist() == want
    )  # readonly
    assert hashing.block_digests(data[page_bytes:], page_bytes).tolist() == want[1:]


_DEVICE_HASH_CHECK = """
import sys
import numpy as np, torch, xxhash
from kvsnap.transfer import page_hash
for page_bytes in map(int, sys.argv[1:]):
    data = np.random.default_rng(page_bytes).integers(0, 256, page_bytes * 3, dtype=np.uint8)
    digests = torch.zeros(3, dtype=torch.int64)
    page_hash.launch_page_digests(
        torch.from_numpy(data.copy()), torch.arange(3, dtype=torch.int64) * page_bytes,
        page_bytes, torch.from_numpy(page_hash.constant_table(page_bytes)), digests)
    want = [xxhash.xxh3_64_intdigest(data[i * page_bytes:(i + 1) * page_bytes].tobytes())
            for i in range(3)]
    got = digests.numpy().view(np.uint64).tolist()
    print(page_bytes, "ok" if got == want else f"MISMATCH {got} {want}")
"""


def test_the_device_kernel_hashes_like_xxhash():
    # The GPU kernel, run on host memory by Triton's interpreter (compiled on the GPU:
    # tests/pipeline/test_pipeline_gpu.py).
    # The interpreter must be chosen before Triton is imported: a fresh process.
    sizes = ["248", "256", "1024", "1032", "2048", "4096", "18432", "32768"]
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_HASH_CHECK, *sizes],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [word for size in sizes for word in (size, "ok")]


_DEVICE_CHECK = """
import sys
import numpy as np, torch, xxhash
from kvsnap.transfer import page_hash
page_bytes = int(sys.argv[1])
rng = np.random.default_rng(7)
data = rng.integers(0, 256, page_bytes * 6, dtype=np.uint8)
stored = np.array([xxhash.xxh3_64_intdigest(data[i * page_bytes:(i + 1) * page_bytes].tobytes())
                   for i in range(6)], dtype=np.uint64)
stored[2] ^= 1  # a stored digest one bit off: the page must be refused
data[4 * page_bytes + 100] ^= 0x40  # a page one bit off: refused too
flags = torch.full((5,), 7, dtype=torch.int64)
# Pages 1..5, at their words: the kernel reads only the pages it is given.
page_hash.launch_page_checks_at_words(
    torch.from_numpy(data.copy()), torch.arange(1, 6, dtype=torch.int64) * (page_bytes // 8),
    page_bytes, torch.from_numpy(page_hash.constant_table(page_bytes)),
    torch.from_numpy(stored[1:].view(np.int64).copy()), flags)
print(*flags.tolist())
"""


def test_the_device_check_flags_exactly_the_pages_whose_digest_differs():
    # The restore's digest-and-compare launch, run by Triton's interpreter in a fresh process.
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_CHECK, "4096"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0", "1", "0", "1"]


def test_pages_outside_the_long_path_are_left_to_the_host():
    assert not page_hash.supports(240) and not page_hash.supports(1020)
    assert page_hash.supports(248) and page_hash.supports(32768)


# --------------------------------------------------------------------------------------------
# The trailer


def test_trailer_round_trip_and_self_check() -> None:
    digests = [xxhash.xxh3_128_digest(bytes([i])) for i in range(5)]
    raw = fmt.encode_trailer(digests)
    assert fmt.decode_trailer(raw) == digests
    for position in range(0, len(raw), 7):
        flipped = bytearray(raw)
        flipped[position] ^= 0x10
        with pytest.raises(SnapshotCorruptError, match="trailer"):
            fmt.decode_trailer(bytes(flipped), file="x")
