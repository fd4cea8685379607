"""Look up and load a prompt's blocks from a vLLM fs-tier root with vLLM's own code.

Usage (``.venv-vllm``): ``python vllm_fs_read_back.py ROOT CONFIG PROMPT OUT``. vLLM's
``FileMapper`` is built from the namespace's fields (it must name the namespace that CONFIG
sits in), the prompt's block hashes are computed by vLLM's prefix-cache code
(``hash_block_tokens`` with its ``sha256`` hash function and ``NONE_HASH``), the fs tier's
lookup (``FsAsyncLookupManager.batch_lookup``) says which blocks it would serve, and its loader
(``batch_load_block``) reads them into one buffer, as it reads them into the host region.
OUT gets ``found`` (one bool per full block), ``hashes`` (hex), ``paths``, and the loaded
bytes in ``OUT.bin``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.io import batch_load_block
from vllm.v1.kv_offload.tiering.fs.manager import FsAsyncLookupManager

_MAPPER_FIELDS = (
    "model_name",
    "tokens_per_hash",
    "blocks_per_file",
    "tp_size",
    "pp_size",
    "pcp_size",
    "dcp_size",
    "dtype",
    "kv_cache_groups",
    "inference_engine",
)


def main(root: str, config: str, prompt: str, out: str) -> None:
    fields = json.loads(Path(config).read_text())
    mapper = FileMapper(
        root_dir=root,
        rank=0,
        parallel_agnostic=fields.get("parallel_agnostic", True),
        **{name: fields[name] for name in _MAPPER_FIELDS},
    )
    assert Path(mapper.get_config_file_path()) == Path(config), mapper.get_config_file_path()
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    tokens = json.loads(Path(prompt).read_text())
    block = int(fields["kv_cache_groups"][0]["tokens_per_block"])
    parent, keys, hashes = kv_cache_utils.NONE_HASH, [], []
    for start in range(0, len(tokens) - block + 1, block):
        parent = kv_cache_utils.hash_block_tokens(
            hash_fn, parent, tokens[start : start + block], None
        )
        hashes.append(bytes(parent).hex())
        keys.append(make_offload_key(parent, 0))
    tier = types.SimpleNamespace(_tier=types.SimpleNamespace(file_mapper=mapper))
    found = [bool(hit) for hit in FsAsyncLookupManager.batch_lookup(tier, keys, None)]
    paths = [mapper.get_file_name(key) for key in keys]
    size = Path(paths[0]).stat().st_size
    buffer = bytearray(size * len(keys))
    batch_load_block(paths, memoryview(buffer), [i * size for i in range(len(keys))], size, False)
    Path(out).write_text(json.dumps({"found": found, "hashes": hashes, "paths": paths}))
    Path(out + ".bin").write_bytes(bytes(buffer))


if __name__ == "__main__":
    main(*sys.argv[1:5])
