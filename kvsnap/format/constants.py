"""The format's constants: version, names of kvsnap's own tensors, alignment, limits."""

from __future__ import annotations

import re
import struct

#: The format version this module writes; readers accept every version in SUPPORTED_VERSIONS.
FORMAT_VERSION = 1
#: The version of a parted snapshot's part files and index (plain snapshots stay version 1, so
#: their bytes never change; a reader that knows only version 1 refuses parts with "upgrade").
PARTS_FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
#: ``__metadata__`` key holding the kvsnap JSON (safetensors metadata values must be strings).
METADATA_KEY = "kvsnap"
#: File offsets of the data region and of every layer tensor are multiples of this (O_DIRECT).
DATA_ALIGNMENT = 4096
#: Largest header accepted (safetensors' own limit), checked before anything is allocated.
MAX_HEADER_BYTES = 100_000_000
#: Largest sharded-snapshot index file accepted.
MAX_INDEX_BYTES = 64 << 20
DIGEST_BYTES = 16
TENSOR_CHECKSUM = "xxh3-128"
BLOCK_CHECKSUM = "xxh3-64"

BLOCK_HASHES_TENSOR = "kvsnap.block_hashes"
BLOCK_CHECKSUMS_TENSOR = "kvsnap.block_checksums"
CHECKSUMS_TENSOR = "kvsnap.checksums"
PADDING_PREFIX = "kvsnap.padding."
#: A signed file's last tensor, after the trailer: key id, then the HMAC (docs/format.md).
SIGNATURE_TENSOR = "kvsnap.signature"
#: What new signed files are: an HMAC over the header and every byte but the pages, which are
#: bound by their BLAKE3 digests (:data:`PAGE_DIGESTS_TENSOR`).
SIGNATURE_ALGORITHM = "hmac-sha256-blake3"
#: Signed files written before pages were bound by BLAKE3: an HMAC over the header and the
#: checksum trailer, pages bound by xxh3-64 only (still read).
SIGNATURE_ALGORITHM_V1 = "hmac-sha256"
SIGNATURE_ALGORITHMS = (SIGNATURE_ALGORITHM, SIGNATURE_ALGORITHM_V1)
#: A file signed with :data:`SIGNATURE_ALGORITHM` holds this tensor right before its trailer:
#: the BLAKE3-256 of every page of its layer tensors, ``(layer tensors, blocks, 32)``.
PAGE_DIGESTS_TENSOR = "kvsnap.page_digests"
PAGE_DIGEST = "blake3"
PAGE_DIGEST_BYTES = 32
KEY_ID_BYTES = 16
SIGNATURE_BYTES = KEY_ID_BYTES + 32

NHD_ENCODING = "kvsnap-nhd-v1"
MLA_ENCODING = "kvsnap-mla-v1"

#: Root parent of every prefix hash chain.
ROOT_DIGEST = bytes(DIGEST_BYTES)
#: Stored in ``kvsnap.block_hashes`` for blocks that no sequence references.
NO_HASH = bytes(DIGEST_BYTES)

#: A prefix hash or digest as text: 32 lowercase hex digits.
HEX32 = re.compile(r"[0-9a-f]{32}")
CREATED_PATTERN = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z"
)
#: The safetensors length prefix: the header JSON length, u64 little-endian.
HEADER_PREFIX = struct.Struct("<Q")
