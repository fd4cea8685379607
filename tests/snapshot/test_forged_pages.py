"""Page forgery against signed snapshots (issue 37, defect 1), as an attacker does it.

Two tenants' snapshots, X's and Y's, are signed with the store's key. The attacker can read
both files and write Y's, but has no key. Each attacked page of Y's file is replaced by X's page
at the same place, forged (tests/support/xxh3_forgery.py: four words changed) to carry the
xxh3-64 of the page it replaces; every other byte of the file (header, checksums, trailer,
signature) stays as it was. The xxh3 checksums cannot notice this: they are an accident check.
A key must: with one, the forged pages are reported by layer tensor and block, a restore
refuses them, and ``kvsnap verify --key-file`` fails naming them. A snapshot signed before
pages were bound cryptographically (the signature covering only the header and the xxh3
checksum trailer) still opens with its key, and ``kvsnap inspect`` names its weaker binding.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from typer.testing import CliRunner

import kvsnap
from kvsnap import format as fmt
from kvsnap.cli.app import app
from kvsnap.errors import KVSnapError
from kvsnap.snapshot import SequenceBlocks, Snapshot
from kvsnap.store.files.keys import load_key_ring, new_key_text
from tests.support.xxh3_forgery import forge_page, forged_word_offsets

LAYERS, CACHE_BLOCKS, BLOCK, HEADS, HEAD_DIM = 2, 4, 16, 8, 128
PAGE_BYTES = BLOCK * HEADS * HEAD_DIM * 2  # bfloat16: the common 32 KiB page
TENANT_X, TENANT_Y = "tenant-x", "tenant-y"
TENANT_BLOCKS = [2, 0]  # cache blocks holding each tenant's 32 tokens
TARGET_BLOCKS = [3, 1]  # where a restore puts tenant Y's blocks
#: The pages the default run forges (two of the eight, ~2-3 s each); every page with --run-slow.
SOME_PAGES = (("layers.0.key", 0), ("layers.1.value", 1))

runner = CliRunner()


def random_caches(seed: int) -> list[torch.Tensor]:
    """A vLLM split cache of random bfloat16 bit patterns (NaN and Inf included)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (CACHE_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)
    return [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def tensor_spans(raw: bytes | bytearray) -> dict[str, tuple[int, int]]:
    """Absolute ``[begin, end)`` of every tensor of a safetensors file."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__")
    start = 8 + length
    return {
        name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
        for name, entry in header.items()
    }


def page_span(raw: bytes | bytearray, tensor: str, block: int) -> slice:
    """Where page ``block`` of layer tensor ``tensor`` lies in a snapshot file's bytes."""
    begin, _ = tensor_spans(raw)[tensor]
    return slice(begin + block * PAGE_BYTES, begin + (block + 1) * PAGE_BYTES)


def layer_tensors() -> list[str]:
    return [f"layers.{layer}.{kind}" for layer in range(LAYERS) for kind in ("key", "value")]


def signed_the_old_way(unsigned: Path, out: Path, key: bytes) -> None:
    """``unsigned`` signed as kvsnap signed files while pages were bound to the signature only
    through their xxh3-64 checksums (docs/format.md, "Signed snapshots", up to 2026-12-06):
    ``"signature": "hmac-sha256"`` in the metadata, a ``kvsnap.signature`` tensor after the
    trailer, the trailer's header row and last row recomputed, and the HMAC over the header and
    the trailer. Built from the format's description, not by kvsnap's writer, which no longer
    writes such files."""
    raw = unsigned.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + length
    header = json.loads(raw[8:data_start])
    metadata = json.loads(header["__metadata__"]["kvsnap"])
    metadata["signature"] = "hmac-sha256"
    header["__metadata__"]["kvsnap"] = json.dumps(metadata, separators=(",", ":"))
    begin, end = header[fmt.CHECKSUMS_TENSOR]["data_offsets"]
    assert data_start + end == len(raw), "the trailer ends an unsigned file"
    header[fmt.SIGNATURE_TENSOR] = {"dtype": "U8", "shape": [48], "data_offsets": [end, end + 48]}
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length, "the header's padding has room for the signature's entry"
    new_header = struct.pack("<Q", length) + text + b" " * (length - len(text))
    rows = xxhash.xxh3_128_digest(new_header) + raw[data_start + begin + 16 : data_start + end - 16]
    trailer = rows + xxhash.xxh3_128_digest(rows)
    key_id = hmac.new(key, b"kvsnap-key-id-v1", hashlib.sha256).digest()[:16]
    mac = hmac.new(key, b"kvsnap-signature-v1\0" + new_header + trailer, hashlib.sha256).digest()
    out.write_bytes(new_header + raw[data_start : data_start + begin] + trailer + key_id + mac)


@dataclass(frozen=True)
class Tenants:
    """Tenant X's and Y's signed snapshots, Y's unsigned one, and the store's key file."""

    key_file: Path
    x_signed: Path
    y_signed: Path
    y_unsigned: Path


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Tenants:
    directory = tmp_path_factory.mktemp("tenants")
    key_file = directory / "store.key"
    key_file.write_text(new_key_text() + "\n")
    key_file.chmod(0o600)
    # Different prompts, different KV, one geometry; Y's unsigned file holds Y's signed pages.
    prompts = {
        TENANT_X: np.arange(5000, 5000 + 2 * BLOCK),
        TENANT_Y: np.arange(1000, 1000 + 2 * BLOCK),
    }
    seeds = {TENANT_X: 1, TENANT_Y: 2}
    paths = {}
    for tenant, signed in ((TENANT_X, True), (TENANT_Y, True), (TENANT_Y, False)):
        path = directory / f"{tenant}-{'signed' if signed else 'unsigned'}.safetensors"
        kvsnap.capture(
            kvsnap.vllm_split_layout(random_caches(seeds[tenant])),
            [SequenceBlocks(tenant, prompts[tenant], np.array(TENANT_BLOCKS))],
            path,
            keys=load_key_ring(key_file) if signed else None,
            reproducible=True,
        )
        paths[tenant, signed] = path
    return Tenants(key_file, paths[TENANT_X, True], paths[TENANT_Y, True], paths[TENANT_Y, False])


@dataclass(frozen=True)
class Attack:
    """Y's files with the attacked pages replaced by X's, forged to Y's xxh3-64."""

    tenants: Tenants
    pages: dict[tuple[str, int], bytes]  # (layer tensor, block) -> the forged page
    signed: Path
    unsigned: Path


def forge_file(original: Path, forged_pages: dict[tuple[str, int], bytes], out: Path) -> None:
    raw = bytearray(original.read_bytes())
    for (tensor, block), page in forged_pages.items():
        raw[page_span(raw, tensor, block)] = page
    out.write_bytes(bytes(raw))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(SOME_PAGES, id="two-pages"),
        pytest.param(
            tuple(
                (tensor, block) for tensor in layer_tensors() for block in range(len(TENANT_BLOCKS))
            ),
            id="every-page",
            marks=pytest.mark.slow,
        ),
    ],
)
def attack(request: pytest.FixtureRequest, tenants: Tenants) -> Attack:
    x_raw, y_raw = tenants.x_signed.read_bytes(), tenants.y_signed.read_bytes()
    pages = {}
    for tensor, block in request.param:
        target = xxhash.xxh3_64_intdigest(y_raw[page_span(y_raw, tensor, block)])
        pages[tensor, block] = forge_page(x_raw[page_span(x_raw, tensor, block)], target)
    directory = tenants.key_file.parent
    signed = directory / f"forged-{len(pages)}-signed.safetensors"
    unsigned = directory / f"forged-{len(pages)}-unsigned.safetensors"
    forge_file(tenants.y_signed, pages, signed)
    forge_file(tenants.y_unsigned, pages, unsigned)
    return Attack(tenants, pages, signed, unsigned)


# -- what holds with or without the fix: xxh3 checksums are an accident check ---------------


def test_the_forged_pages_carry_y_xxh3_and_no_other_byte_changes(attack) -> None:
    x_raw = attack.tenants.x_signed.read_bytes()
    offsets = set(forged_word_offsets(PAGE_BYTES))
    for original, forged in (
        (attack.tenants.y_signed.read_bytes(), attack.signed.read_bytes()),
        (attack.tenants.y_unsigned.read_bytes(), attack.unsigned.read_bytes()),
    ):
        assert len(forged) == len(original)
        rest = bytearray(forged)
        for (tensor, block), page in attack.pages.items():
            span = page_span(forged, tensor, block)
            assert forged[span] == page != original[span]
            assert xxhash.xxh3_64_intdigest(page) == xxhash.xxh3_64_intdigest(original[span])
            # X's page but for the forger's four words, which lie where it says.
            x_page = x_raw[page_span(x_raw, tensor, block)]
            changed = {
                at for at in range(0, PAGE_BYTES, 8) if page[at : at + 8] != x_page[at : at + 8]
            }
            assert changed <= offsets
            rest[span] = original[span]
        # The header, every checksum, the trailer and the signature: byte for byte.
        assert bytes(rest) == original


def test_without_a_key_the_forged_unsigned_snapshot_passes_every_check(attack) -> None:
    with Snapshot.open(attack.unsigned) as snapshot:
        assert snapshot.verify() == []


# -- what the key must add (fails until pages are bound cryptographically) ------------------


def test_with_the_key_verify_reports_each_forged_page_by_tensor_and_block(attack) -> None:
    keys = load_key_ring(attack.tenants.key_file)
    with Snapshot.open(attack.signed, keys=keys) as snapshot:
        problems = snapshot.verify()
    named = {(problem.tensor, problem.block) for problem in problems if problem.block is not None}
    assert named == set(attack.pages), problems
    assert {problem.tensor for problem in problems} <= {tensor for tensor, _ in attack.pages}


def test_with_the_key_a_restore_refuses_and_never_writes_a_forged_page(attack) -> None:
    keys = load_key_ring(attack.tenants.key_file)
    target = [torch.zeros_like(cache) for cache in random_caches(0)]
    with pytest.raises(KVSnapError):
        with Snapshot.open(attack.signed, keys=keys) as snapshot:
            snapshot.restore(kvsnap.vllm_split_layout(target), {TENANT_Y: TARGET_BLOCKS})
    written = {
        target[layer][block, kind].contiguous().view(torch.uint8).numpy().tobytes()
        for layer in range(LAYERS)
        for block in TARGET_BLOCKS
        for kind in (0, 1)
    }
    assert not written & set(attack.pages.values())


def test_kvsnap_verify_with_the_key_file_fails_naming_each_forged_page(attack) -> None:
    key_file = str(attack.tenants.key_file)
    result = runner.invoke(app, ["verify", str(attack.signed), "--key-file", key_file, "--json"])
    assert result.exit_code == 1, result.stdout
    report = json.loads(result.stdout)
    named = {(problem["tensor"], problem["block"]) for problem in report["problems"]}
    assert set(attack.pages) <= named, report
    # The intact file still verifies with the same key.
    intact = runner.invoke(
        app, ["verify", str(attack.tenants.y_signed), "--key-file", key_file, "--json"]
    )
    assert intact.exit_code == 0, intact.stdout


def test_a_file_signed_the_old_way_opens_with_its_key_and_inspect_names_its_weaker_binding(
    tenants, tmp_path: Path
) -> None:
    old = tmp_path / "old-signed.safetensors"
    keys = load_key_ring(tenants.key_file)
    signed_the_old_way(tenants.y_unsigned, old, keys.keys[0].secret)
    with Snapshot.open(old, keys=keys) as snapshot:
        assert snapshot.verify() == []
    verified = runner.invoke(app, ["verify", str(old), "--key-file", str(tenants.key_file)])
    assert verified.exit_code == 0, verified.stdout
    result = runner.invoke(app, ["inspect", str(old)])
    assert result.exit_code == 0
    described = re.sub(r"[\s│]+", " ", result.stdout)
    assert re.search(r"xxh3", described, re.IGNORECASE), described
