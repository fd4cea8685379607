"""The kvsnap snapshot format (versions 1 and 2): a safetensors container with kvsnap metadata.

This package is pure bytes-in-memory, one module per job:

- :mod:`~kvsnap.format.constants`: version, tensor names, alignment, limits;
- :mod:`~kvsnap.format.metadata`: the metadata dataclasses (:class:`SnapshotMetadata`, ...);
- :mod:`~kvsnap.format.schema`: strict JSON and the metadata JSON Schema;
- :mod:`~kvsnap.format.parse`: the metadata JSON parsed and validated (:class:`HeaderMetadata`);
- :mod:`~kvsnap.format.container`: the exact file layout (which tensor goes where, padding,
  sharding) and the header bytes;
- :mod:`~kvsnap.format.header`: strict decoding of a file's header;
- :mod:`~kvsnap.format.index`: shard file names and the sharded snapshot's index;
- :mod:`~kvsnap.format.parts`: part file names and the parted snapshot's index (version 2);
- :mod:`~kvsnap.format.hashing`: prefix hash chains, block dedupe, checksums, BLAKE3 page
  digests, the trailer;
- :mod:`~kvsnap.format.fingerprint`: model fingerprints (config and weights);
- :mod:`~kvsnap.format.signing`: signed files (the HMAC over every byte but the pages, which
  their BLAKE3 digests bind).

All file and object-store I/O lives in :mod:`kvsnap.store`. ``docs/format.md`` is the prose
specification.

A snapshot file, in file order::

    u64 little-endian N | N bytes of header JSON, padded with spaces so data starts 4096-aligned
    sequences.{j}.token_ids   I64 (num_tokens,)            for every sequence j
    sequences.{j}.block_ids   I64 (num_blocks_of_seq,)     indices into the block axis
    kvsnap.block_hashes       U8  (num_blocks, 16)         prefix hash of every snapshot block
    layers.{i}.{part}         model dtype (num_blocks, *canonical_page_shape), each 4096-aligned
    kvsnap.block_checksums    U64 (num_layer_tensors, num_blocks)   xxh3-64 of every page
    kvsnap.page_digests       U8  (layer tensors, num_blocks, 32)   signed files: BLAKE3-256
    kvsnap.checksums          U8  (rows, 16)               xxh3-128 trailer (see below)
    kvsnap.signature          U8  (48,)                    signed files: key id and HMAC

with ``kvsnap.padding.<next tensor>`` (U8 zeros) wherever the next tensor needs alignment.
Everything in the header is known before the first data byte, so a writer streams the file
strictly front to back; the data-dependent checksums go to the last two tensors. The trailer
``kvsnap.checksums`` holds, as 16-byte xxh3-128 digests: row 0 the header bytes
``[0, data_start)``; then one row per tensor in file order (padding and the trailer excluded) —
for a layer tensor the digest of its row of ``kvsnap.block_checksums`` (little-endian u64),
for any other tensor the digest of its bytes; and last the digest of all previous rows. Every
byte of the file is therefore covered: the header and tensors by the trailer, the trailer by
its last row, padding by being required zero.
"""

from __future__ import annotations

from kvsnap.format.canonical import canonical_header
from kvsnap.format.constants import (
    BLOCK_CHECKSUM,
    BLOCK_CHECKSUMS_TENSOR,
    BLOCK_HASHES_TENSOR,
    CHECKSUMS_TENSOR,
    DATA_ALIGNMENT,
    DIGEST_BYTES,
    FORMAT_VERSION,
    KEY_ID_BYTES,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    METADATA_KEY,
    MLA_ENCODING,
    NHD_ENCODING,
    NO_HASH,
    PADDING_PREFIX,
    PAGE_DIGEST,
    PAGE_DIGEST_BYTES,
    PAGE_DIGESTS_TENSOR,
    PARTS_FORMAT_VERSION,
    ROOT_DIGEST,
    SIGNATURE_ALGORITHM,
    SIGNATURE_ALGORITHM_V1,
    SIGNATURE_ALGORITHMS,
    SIGNATURE_BYTES,
    SIGNATURE_TENSOR,
    SUPPORTED_VERSIONS,
    TENSOR_CHECKSUM,
)
from kvsnap.format.container import (
    FileLayout,
    TensorEntry,
    TensorSpec,
    file_layouts,
    file_specs,
    is_container_tensor,
    is_layer_tensor,
    is_signed_bytes_tensor,
    pack_file,
    snapshot_specs,
    specs_for,
    split_shards,
)
from kvsnap.format.fingerprint import (
    VOLATILE_CONFIG_KEYS,
    WeightSample,
    bfloat16_bits,
    model_fingerprint,
    model_fingerprint_with_weights,
    sample_windows,
    weights_fingerprint,
)
from kvsnap.format.hashing import (
    BlockDedupe,
    block_digests,
    decode_trailer,
    dedupe_blocks,
    digest128,
    encode_trailer,
    layer_tensor_digest,
    page_digest_failures,
    page_digests,
    prefix_hash_chain,
)
from kvsnap.format.header import (
    DecodedHeader,
    decode_header,
    expected_layout,
    header_length,
    locate_trailer,
)
from kvsnap.format.index import (
    GENERATION_PATTERN,
    ShardIndex,
    decode_index,
    encode_index,
    is_shard_of,
    new_generation,
    shard_file_name,
)
from kvsnap.format.metadata import (
    PartInfo,
    Problem,
    SequenceRecord,
    SnapshotMetadata,
    SourceInfo,
    canonical_encoding,
    utc_now,
)
from kvsnap.format.parse import (
    HeaderMetadata,
    SequenceShape,
    check_version,
    parse_metadata_document,
    parse_metadata_json,
)
from kvsnap.format.parts import (
    PARTS_KEY,
    PartRecord,
    PartsIndex,
    decode_parts_index,
    encode_parts_index,
    is_part_of,
    is_parts_index,
    part_file_name,
    whole_geometry,
)
from kvsnap.format.schema import (
    metadata_schema,
    strict_json_loads,
)
from kvsnap.format.signing import KeyRing, SigningKey, signed_entries

__all__ = [
    "BLOCK_CHECKSUM",
    "BLOCK_CHECKSUMS_TENSOR",
    "BLOCK_HASHES_TENSOR",
    "CHECKSUMS_TENSOR",
    "DATA_ALIGNMENT",
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "GENERATION_PATTERN",
    "KEY_ID_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "METADATA_KEY",
    "MLA_ENCODING",
    "NHD_ENCODING",
    "NO_HASH",
    "PADDING_PREFIX",
    "PAGE_DIGEST",
    "PAGE_DIGESTS_TENSOR",
    "PAGE_DIGEST_BYTES",
    "PARTS_FORMAT_VERSION",
    "PARTS_KEY",
    "ROOT_DIGEST",
    "SIGNATURE_ALGORITHM",
    "SIGNATURE_ALGORITHMS",
    "SIGNATURE_ALGORITHM_V1",
    "SIGNATURE_BYTES",
    "SIGNATURE_TENSOR",
    "SUPPORTED_VERSIONS",
    "TENSOR_CHECKSUM",
    "VOLATILE_CONFIG_KEYS",
    "BlockDedupe",
    "DecodedHeader",
    "FileLayout",
    "HeaderMetadata",
    "KeyRing",
    "PartInfo",
    "PartRecord",
    "PartsIndex",
    "Problem",
    "SequenceRecord",
    "SequenceShape",
    "ShardIndex",
    "SigningKey",
    "SnapshotMetadata",
    "SourceInfo",
    "TensorEntry",
    "TensorSpec",
    "WeightSample",
    "bfloat16_bits",
    "block_digests",
    "canonical_encoding",
    "canonical_header",
    "check_version",
    "decode_header",
    "decode_index",
    "decode_parts_index",
    "decode_trailer",
    "dedupe_blocks",
    "digest128",
    "encode_index",
    "encode_parts_index",
    "encode_trailer",
    "expected_layout",
    "file_layouts",
    "file_specs",
    "header_length",
    "is_container_tensor",
    "is_layer_tensor",
    "is_part_of",
    "is_parts_index",
    "is_shard_of",
    "is_signed_bytes_tensor",
    "layer_tensor_digest",
    "locate_trailer",
    "metadata_schema",
    "model_fingerprint",
    "model_fingerprint_with_weights",
    "new_generation",
    "pack_file",
    "page_digest_failures",
    "page_digests",
    "parse_metadata_document",
    "parse_metadata_json",
    "part_file_name",
    "prefix_hash_chain",
    "sample_windows",
    "shard_file_name",
    "signed_entries",
    "snapshot_specs",
    "specs_for",
    "split_shards",
    "strict_json_loads",
    "utc_now",
    "weights_fingerprint",
    "whole_geometry",
]
