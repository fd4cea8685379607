"""SGLang HiCache's ``file`` storage backend: one headerless file per page, per TP rank.

Layout on disk (``sglang/srt/mem_cache/hicache_storage.py`` ``HiCacheFile``, SGLang 0.5.23)::

    DIR/<page hash>_<model>_<tp_rank>_<tp_size>[_<pp_size>_<pp_rank>].bin   MHA: one per rank
    DIR/<page hash>_<model>[_<pp_size>_<pp_rank>].bin                       MLA: one, shared
    DIR/.<uuid hex>.tmp                                                     a write under way

``DIR`` is ``--hicache-storage-backend file``'s directory (``/tmp/hicache`` by default),
``<model>`` the served model's name with ``/`` as ``-``, ``<page hash>`` SGLang's page hash
(SHA-256 over the previous page's digest and the page's token ids as little-endian u32).
A file is the host pool's page, flattened, in its layout (``--hicache-mem-layout``):
``layer_first`` and ``page_first_direct`` ``(2, layers, page, heads, head_dim)``,
``page_first`` ``(2, page, layers, heads, head_dim)``; MLA pages have no K/V axis and one
latent per token (``(layers, page, 1, latent)``, ``page_first``: ``(page, layers, 1,
latent)``). Nothing in a file says the layout, the geometry, the dtype or the tokens: see
docs/foreign.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap.dtypes import kv_element, kv_torch_dtype
from kvsnap.errors import LayoutError, NotASnapshotError, SnapshotCorruptError, SnapshotIOError
from kvsnap.layout import KVGeometry

from .base import (
    ForeignBlock,
    ForeignFormat,
    ForeignProblem,
    ForeignSequence,
    ForeignSource,
    Recognition,
)
from .pages import own_tensor, size_problems

if TYPE_CHECKING:  # pages are tensors; recognising and describing a pool need no torch
    import torch

FORMAT_NAME = "sglang-hicache"
ENGINE_VERSION = "0.5.23"
#: The host pool layouts whose pages kvsnap decodes (``--hicache-mem-layout``).
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_PAGE_FILE = re.compile(r"^([0-9a-f]{64})_(.+)\.bin$")
_TMP_FILE = re.compile(r"^\.[0-9a-f]{32}\.tmp$")
#: The rank suffix of an MHA page: ``_<tp_rank>_<tp_size>``, optionally ``_<pp_size>_<pp_rank>``.
_MHA_SUFFIX = re.compile(r"^(.*)_([0-9]+)_([0-9]+)(?:_([0-9]+)_([0-9]+))?$")
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

CANNOT_TELL = (
    "no checksums: a flipped bit in a page file is invisible; only names, sizes and which "
    "ranks hold each page can be checked",
    "no token ids: a page is found only by recomputing SGLang's page hash from the prompt",
    "no model fingerprint: the file names carry the served model's name, not its weights",
    "no geometry, dtype or host layout: layers, heads and head size come from the model's "
    "config, the layout (layer_first, page_first, page_first_direct) is a hint",
)


def page_hashes(token_ids: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """SGLang's storage hashes of the full pages of a prompt, as hex.

    ``h = SHA-256(previous digest ‖ the page's token ids as little-endian u32)``; the first
    page has no previous digest unless the request had a namespace seed (``seed``, hex).
    """
    parent = bytes.fromhex(seed) if seed else b""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = [int(token) for token in token_ids[start : start + page_size]]
        digest = hashlib.sha256(parent + struct.pack(f"<{len(page)}I", *page)).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes


@dataclass(frozen=True)
class PageFile:
    """One page file's name, parsed: its hash, model, and (MHA) its rank and TP size."""

    path: Path
    digest: str
    model: str
    tp_rank: int | None
    tp_size: int | None

    @property
    def group(self) -> tuple[str, int | None]:
        return self.model, self.tp_size


def _parse(path: Path) -> PageFile | None:
    match = _PAGE_FILE.match(path.name)
    if match is None:
        return None
    digest, suffix = match.groups()
    ranked = _MHA_SUFFIX.match(suffix)
    if ranked is not None and int(ranked.group(2)) < int(ranked.group(3)):
        return PageFile(path, digest, ranked.group(1), int(ranked.group(2)), int(ranked.group(3)))
    return PageFile(path, digest, suffix, None, None)


def _page_files(directory: Path) -> list[PageFile]:
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return []
    return [page for page in map(_parse, children) if page is not None and page.path.is_file()]


def recognise(path: Path) -> Recognition:
    """A directory of HiCache page files, or one page file."""
    if path.is_file():
        if _parse(path) is not None:
            return Recognition(True, "an SGLang HiCache page file")
        return Recognition(False, "not an SGLang HiCache page file (<64 hex>_<model>_...bin)")
    if path.is_dir():
        if _page_files(path):
            return Recognition(True, "an SGLang HiCache file-storage directory")
        return Recognition(False, "no SGLang HiCache page file (<64 hex>_<model>_...bin) in it")
    return Recognition(False, "neither a file nor a directory")


def open_hicache(path: Path, hints: Mapping[str, Any]) -> HiCacheDirectory:
    """Open the storage directory ``path`` is or holds one page file of."""
    if not recognise(path).matches:
        raise NotASnapshotError(recognise(path).found, file=str(path))
    directory = path.parent if path.is_file() else path
    return HiCacheDirectory(directory, hints, only=path if path.is_file() else None)


class HiCacheDirectory(ForeignSource):
    """One HiCache ``file`` storage directory.

    ``hints`` (all optional but ``tokens`` to find a prompt, and the geometry to decode):
    ``model`` (a directory with the model's ``config.json``: layers, KV heads, head size or
    MLA latent, dtype), ``num_kv_heads``, ``head_dim``, ``dtype`` (instead of ``model``),
    ``page_order`` (the host layout: ``layer_first``, ``page_first``, ``page_first_direct``),
    ``page_size`` (default: what the file size gives), ``model_name`` (which served model's
    files, when the directory holds several), ``tokens`` and ``hash_seed`` (the hex digest that
    seeds the page-hash chain of a request with an ``extra_key`` or ``cache_salt``).
    """

    format_name = FORMAT_NAME
    engine = "sglang"
    needs_tokens = True

    def __init__(self, directory: Path, hints: Mapping[str, Any], *, only: Path | None) -> None:
        super().__init__(directory)
        self.hints = dict(hints)
        pages = _page_files(directory)
        if only is not None:
            pages = [page for page in pages if page.path == only]
        self.pages = pages
        self.groups = sorted({page.group for page in pages}, key=str)
        self._config = self._model_config()

    @property
    def version(self) -> str:
        return f"SGLang {ENGINE_VERSION} HiCache file storage"

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        return CANNOT_TELL

    def _model_config(self) -> dict[str, Any] | None:
        model = self.hints.get("model")
        if model is None:
            return None
        config = Path(model) / "config.json"
        try:
            loaded = json.loads(config.read_text())
        except (OSError, ValueError) as error:
            raise LayoutError(f"{config}: cannot read the model config ({error})") from None
        if not isinstance(loaded, dict):
            raise LayoutError(f"{config}: not a model config")
        return dict(loaded.get("text_config", loaded))

    def group(self) -> tuple[str, int | None]:
        """The one (model, TP size) whose pages are read."""
        wanted = self.hints.get("model_name")
        groups = [g for g in self.groups if wanted is None or g[0] == str(wanted).replace("/", "-")]
        if len(groups) != 1:
            names = ", ".join(f"{model} (TP {tp or 'replicated MLA'})" for model, tp in groups)
            raise LayoutError(
                f"{self.path}: pages of {len(groups)} deployments ({names or 'none'}): "
                "pass model_name to choose one"
            )
        return groups[0]

    def _dtype(self) -> str:
        dtype = self.hints.get("dtype") or (self._config or {}).get("torch_dtype")
        dtype = dtype or (self._config or {}).get("dtype")
        if not isinstance(dtype, str):
            raise LayoutError(
                f"{self.path}: HiCache files do not record the KV dtype and the model config "
                "names none: pass --model DIR with a torch_dtype (dtype= from Python)"
            )
        return dtype

    def _shape(self) -> tuple[int, int, int, int] | None:
        """``(layers, heads per file, head_dim, latent)`` from the hints and model config."""
        config = self._config or {}
        layers = config.get("num_hidden_layers")
        if config.get("kv_lora_rank"):
            latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
            return (int(layers), 0, 0, latent) if layers else None
        heads = self.hints.get("num_kv_heads") or config.get(
            "num_key_value_heads", config.get("num_attention_heads")
        )
        dim = self.hints.get("head_dim") or config.get("head_dim")
        if dim is None and config.get("hidden_size") and config.get("num_attention_heads"):
            dim = config["hidden_size"] // config["num_attention_heads"]
        if not (layers and heads and dim):
            return None
        tp = self.group()[1] or 1
        if int(heads) % tp:
            raise LayoutError(f"{heads} KV heads do not split over the files' TP {tp}")
        return int(layers), int(heads) // tp, int(dim), 0

    def _token_bytes(self) -> int | None:
        """Bytes one token takes in one file (every layer, K and V or the latent)."""
        shape = self._shape()
        if shape is None:
            return None
        layers, heads, dim, latent = shape
        element = kv_element(self._dtype()).size
        per_layer = latent if latent else 2 * heads * dim
        return layers * per_layer * element

    def _require_shape(self) -> tuple[int, int, int, int]:
        shape = self._shape()
        if shape is None:
            raise LayoutError(
                f"{self.path}: HiCache files do not record the layers, KV heads or head size: "
                "pass --model DIR (model=DIR from Python)"
            )
        return shape

    def page_size(self) -> int:
        """Tokens per page: the hint, else a page file's size over one token's bytes."""
        self._require_shape()
        token = self._token_bytes() or 1
        hinted = self.hints.get("page_size")
        if hinted is not None:
            return int(hinted)
        group = self.group()
        sizes = [page.path.stat().st_size for page in self.pages if page.group == group]
        # The most common size: one damaged file must not decide the page size of the rest.
        size = max(set(sizes), key=sizes.count)
        if size == 0 or size % token:
            raise LayoutError(
                f"{self.path}: pages of {size} bytes are not whole tokens of {token} bytes: "
                "the model config or dtype does not match the files"
            )
        return size // token

    def geometry(self) -> KVGeometry:
        layers, heads, dim, latent = self._require_shape()
        tp = self.group()[1] or 1
        if latent:
            return KVGeometry(layers, self.page_size(), self._dtype(), latent_dim=latent)
        return KVGeometry(layers, self.page_size(), self._dtype(), heads * tp, dim)

    def describe(self) -> dict[str, Any]:
        groups = []
        for model, tp in self.groups:
            members = [page for page in self.pages if page.group == (model, tp)]
            groups.append(
                {
                    "model": model,
                    "tp_size": tp,
                    "mla": tp is None,
                    "pages": len({page.digest for page in members}),
                    "files": len(members),
                    "file_bytes": sorted({page.path.stat().st_size for page in members}),
                }
            )
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "path": str(self.path),
            "deployments": groups,
            "num_files": len(self.pages),
            "total_bytes": sum(page.path.stat().st_size for page in self.pages),
            "temporary_files": len(self._leftovers()),
            "cannot_tell": list(CANNOT_TELL),
        }

    def _leftovers(self) -> list[Path]:
        try:
            return sorted(p for p in self.path.iterdir() if _TMP_FILE.match(p.name))
        except OSError:
            return []

    def verify(self) -> list[ForeignProblem]:
        problems = [
            ForeignProblem(str(p), "a temporary file of an interrupted write")
            for p in self._leftovers()
        ]
        for model, tp in self.groups:
            members = [page for page in self.pages if page.group == (model, tp)]
            problems += size_problems([page.path for page in members], self._expected_size())
            if tp is not None:
                problems += _rank_problems(members, tp)
        return problems

    def _expected_size(self) -> int | None:
        """The exact page file size, when the page size is given and one deployment is here."""
        hinted = self.hints.get("page_size")
        try:
            token = self._token_bytes() if len(self.groups) == 1 else None
        except LayoutError:
            token = None
        return None if token is None or hinted is None else token * int(hinted)

    def sequences(self) -> list[ForeignSequence]:
        tokens = self.hints.get("tokens")
        if tokens is None:
            return []
        size = self.page_size()
        found = []
        for digest in page_hashes(tokens, size, self.hints.get("hash_seed")):
            if not all(path.is_file() for path in self._files_of(digest)):
                break
            found.append(digest)
        ids = np.asarray(tokens[: len(found) * size], dtype=np.int64)
        return [ForeignSequence("prompt", ids, tuple(found))]

    def _files_of(self, digest: str) -> list[Path]:
        """The files of page ``digest``: one per TP rank (MHA), or the one shared file."""
        model, tp = self.group()
        if tp is None:
            return [self.path / f"{digest}_{model}.bin"]
        return [self.path / f"{digest}_{model}_{rank}_{tp}.bin" for rank in range(tp)]

    def read_block(self, block_id: str) -> ForeignBlock:
        layout = self.hints.get("page_order")
        if layout not in LAYOUTS:
            raise LayoutError(
                f"{self.path}: HiCache files do not record the host layout: pass --page-order "
                f"{' or '.join(LAYOUTS)} (SGLang's --hicache-mem-layout; page_order= from Python)"
            )
        geometry = self.geometry()
        dtype = kv_torch_dtype(geometry.dtype)
        keys: list[list[np.ndarray]] = [[] for _ in range(geometry.num_layers)]
        values: list[list[np.ndarray]] = [[] for _ in range(geometry.num_layers)]
        for path in self._files_of(block_id):
            page = _read_page(path, geometry, dtype, self._token_bytes() or 0)
            for layer, (key, value) in enumerate(_split(page, geometry, str(layout))):
                keys[layer].append(key)
                values[layer].append(value)
        if geometry.is_mla:
            latents = tuple(own_tensor(parts[0], dtype) for parts in keys)
            return ForeignBlock(block_id, latents, ())
        return ForeignBlock(
            block_id,
            tuple(own_tensor(np.concatenate(parts, axis=1), dtype) for parts in keys),
            tuple(own_tensor(np.concatenate(parts, axis=1), dtype) for parts in values),
        )


def _read_page(path: Path, geometry: KVGeometry, dtype: torch.dtype, token: int) -> np.ndarray:
    """One page file as words of the KV's element size, its size checked."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotCorruptError("no such page file", file=str(path)) from None
    except OSError as error:
        raise SnapshotIOError(f"cannot read: {error.strerror or error}", file=str(path)) from None
    if len(data) != token * geometry.block_size:
        raise SnapshotCorruptError(
            f"{len(data)} bytes, a page of {geometry.block_size} tokens here has "
            f"{token * geometry.block_size}",
            file=str(path),
        )
    element = dtype.itemsize
    return np.frombuffer(data, dtype=_WORDS[element])


def _split(page: np.ndarray, geometry: KVGeometry, layout: str) -> list[tuple[np.ndarray, Any]]:
    """Per layer, the (tokens, heads, dim) keys and values (MLA: (tokens, latent), None)."""
    layers, tokens = geometry.num_layers, geometry.block_size
    if geometry.is_mla:
        shape = (layers, tokens, geometry.latent_dim)
        if layout == "page_first":
            planes = page.reshape(tokens, layers, geometry.latent_dim).transpose(1, 0, 2)
        else:
            planes = page.reshape(shape)
        return [(planes[layer], None) for layer in range(layers)]
    heads = page.size // (2 * layers * tokens * geometry.head_dim)
    if layout == "page_first":
        kv = page.reshape(2, tokens, layers, heads, geometry.head_dim).transpose(0, 2, 1, 3, 4)
    else:
        kv = page.reshape(2, layers, tokens, heads, geometry.head_dim)
    return [(kv[0, layer], kv[1, layer]) for layer in range(layers)]


def _rank_problems(members: list[PageFile], tp: int) -> list[ForeignProblem]:
    """A page some TP rank stored and another did not cannot be loaded at that TP size."""
    ranks: dict[str, set[int]] = {}
    for page in members:
        ranks.setdefault(page.digest, set()).add(int(page.tp_rank or 0))
    problems = []
    for digest, held in sorted(ranks.items()):
        missing = sorted(set(range(tp)) - held)
        if missing:
            problems.append(
                ForeignProblem(
                    str(members[0].path.parent / f"{digest}_{members[0].model}_*_{tp}.bin"),
                    f"page {digest[:16]}... is missing rank(s) {missing} of TP {tp}",
                )
            )
    return problems


SGLANG_HICACHE = ForeignFormat(
    name=FORMAT_NAME,
    reads=f"SGLang {ENGINE_VERSION} HiCache file storage (directory or page file)",
    recognise=recognise,
    open=open_hicache,
    hints=(
        "model",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "page_order",
        "page_size",
        "model_name",
        "tokens",
        "hash_seed",
    ),
)
