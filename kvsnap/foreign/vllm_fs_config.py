"""vLLM 0.32's fs-tier namespaces: the config's fields, the names and the prefix hashes.

What the reader (``vllm_fs.py``) and the writer (``vllm_fs_export.py``) share: the namespace
directory is named by the SHA-256 of its config, a block file by vLLM's prefix hash of its
tokens, and both are placed by the digits of those hashes (docs/foreign.md).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsnap.errors import NotASnapshotError, SnapshotCorruptError, SnapshotIOError

ENGINE_VERSION = "0.32"
CONFIG_NAME = "config.json"
#: vLLM pads each host-region row, and so each block file, to the page size.
ROW_ALIGNMENT = 4096
#: vLLM's fixed NONE_HASH seed for its cryptographic prefix hashes when PYTHONHASHSEED is unset.
DEFAULT_HASH_SEED = "vllm-none-hash"
_INT_FIELDS = ("tokens_per_hash", "blocks_per_file", "tp_size", "pp_size", "pcp_size", "dcp_size")
BLOCK_NAME = re.compile(r"^([0-9a-f]{16,128})\.bin$")
#: A namespace directory's name ends with ``_`` and 12 hex digits (its config's hash).
NAMESPACE_DIR = re.compile(r"_[0-9a-f]{12}$")
GROUP_DIR = re.compile(r"^([0-9a-f]{2})_g([0-9]+)$")
_MAX_CONFIG_BYTES = 1 << 20


def namespace_digest(fields: Mapping[str, Any]) -> str:
    """The 12 hex digits vLLM names a namespace by: SHA-256 of the compact, sorted JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def namespace_name(fields: Mapping[str, Any]) -> str:
    """The namespace directory's name: the model name with ``/`` as ``_``, then the digest."""
    return f"{str(fields['model_name']).replace('/', '_')}_{namespace_digest(fields)}"


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_HASH_SEED
) -> list[bytes]:
    """vLLM's ``sha256`` prefix-cache hashes of the full blocks of a plain text prompt.

    ``h_0 = SHA-256(pickle(seed))``, then per block ``h = SHA-256(pickle((parent, tokens,
    None)))`` with pickle's highest protocol (no LoRA, multimodal input or cache salt).
    """
    parent = hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(int(token) for token in token_ids[start : start + block_size])
        payload = pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(payload).digest()
        hashes.append(parent)
    return hashes


def read_config(path: Path) -> dict[str, Any]:
    """The namespace's ``config.json``, checked field by field."""
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise NotASnapshotError(
                f"{size} bytes, too large for a vLLM namespace config", file=str(path)
            )
        fields = json.loads(path.read_bytes())
    except OSError as error:
        raise SnapshotIOError(f"cannot read: {error.strerror or error}", file=str(path)) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise SnapshotCorruptError(f"not JSON ({error})", file=str(path)) from None
    problem = _config_problem(fields)
    if problem is not None:
        raise SnapshotCorruptError(
            f"not a vLLM fs-tier namespace config: {problem}", file=str(path)
        )
    return fields


def _config_problem(fields: object) -> str | None:
    """What makes ``fields`` something else than vLLM 0.32's namespace fields, or ``None``."""
    if not isinstance(fields, dict):
        return "not a JSON object"
    if fields.get("inference_engine") != "vllm":
        return f"inference_engine is {fields.get('inference_engine')!r}, not 'vllm'"
    if not isinstance(fields.get("model_name"), str) or not isinstance(fields.get("dtype"), str):
        return "model_name and dtype must be strings"
    for name in _INT_FIELDS:
        value = fields.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{name} must be a positive integer, found {value!r}"
    groups = fields.get("kv_cache_groups")
    if not isinstance(groups, list) or not groups:
        return "kv_cache_groups must be a non-empty list"
    for group in groups:
        names = group.get("layer_names") if isinstance(group, dict) else None
        tokens = group.get("tokens_per_block") if isinstance(group, dict) else None
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            return "each KV cache group needs a non-empty list of layer_names"
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            return "each KV cache group needs a positive tokens_per_block"
    return None


def namespace_of(path: Path) -> Path | None:
    """The namespace directory (holding ``config.json``) that ``path`` is or belongs to."""
    if path.is_file() and BLOCK_NAME.match(path.name):
        rank_dir = path.parent.parent.parent
        base, _, rank = rank_dir.name.rpartition("_r")
        if base and rank.isdigit() and (rank_dir.with_name(base) / CONFIG_NAME).is_file():
            return rank_dir.with_name(base)
        return None
    if not path.is_dir():
        return None
    if (path / CONFIG_NAME).is_file() and (
        NAMESPACE_DIR.search(path.name) or is_vllm_config(path / CONFIG_NAME)
    ):
        return path
    base, _, rank = path.name.rpartition("_r")
    if base and rank.isdigit() and (path.with_name(base) / CONFIG_NAME).is_file():
        return path.with_name(base)
    return None


def is_vllm_config(config: Path) -> bool:
    """Whether ``config`` is a small JSON object naming vLLM as its inference engine."""
    try:
        if config.stat().st_size > _MAX_CONFIG_BYTES:
            return False
        fields = json.loads(config.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(fields, dict) and fields.get("inference_engine") == "vllm"


def namespaces_under(root: Path) -> list[Path]:
    """Directories right under ``root`` holding a config.json that vLLM would have written."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    return [child for child in children if child.is_dir() and is_vllm_config(child / CONFIG_NAME)]


def block_path(rank_dir: Path, digest: str, group: int = 0) -> Path:
    """Where vLLM keeps block ``digest`` (hex) of KV cache group ``group`` in ``rank_dir``."""
    return rank_dir / digest[:3] / f"{digest[3:5]}_g{group}" / f"{digest}.bin"
