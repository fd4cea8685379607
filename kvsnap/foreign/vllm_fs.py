"""vLLM 0.32's ``fs`` offloading tier: a namespace ``config.json`` and one file per block hash.

Layout on disk (``vllm/v1/kv_offload/file_mapper.py`` and ``tiering/fs/``)::

    ROOT/<model>_<h12>/config.json                      the namespace's fields, JSON
    ROOT/<model>_<h12>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin   one chunk of blocks, headerless

``<h12>`` is the first 12 hex digits of SHA-256 over the fields as compact JSON with sorted
keys; ``<hash>`` is the block hash (hex) and ``<hhh>``, ``<hh>`` its first 3 and next 2 digits.
A block file is one row of vLLM's host offload region: per worker, per layer in the group's
order, ``blocks_per_file`` engine pages, padded to a multiple of 4096 bytes. Nothing in it
says the page layout, the heads or the token ids: see docs/foreign.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.dtypes import kv_element
from kvsnap.dtypes import kv_torch_dtype as torch_dtype
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
from .pages import (
    CELL_ORDERS,
    FileOrder,
    PageOrder,
    cell_order,
    decode_bytes,
    load_page_order,
    tile_pages,
)
from .vllm_fs_config import (
    BLOCK_NAME,
    CONFIG_NAME,
    DEFAULT_HASH_SEED,
    ENGINE_VERSION,
    GROUP_DIR,
    NAMESPACE_DIR,
    ROW_ALIGNMENT,
    block_path,
    glob_escape,
    namespace_digest,
    namespace_name,
    namespace_of,
    namespaces_under,
    placement_problems,
    prefix_hashes,
    read_config,
)

FORMAT_NAME = "vllm-fs"

CANNOT_TELL = (
    "no checksums: a flipped bit in a block file is invisible; only names, sizes and the "
    "namespace hash can be checked",
    "no token ids: a block is found only by recomputing vLLM's prefix hash from the prompt",
    "no model fingerprint: model_name is a name or path, not the weights",
    "no page layout or head count: the KV heads, head size and the engine's page order come "
    "from the model's config and a hint, not from the files",
    "no parallel layout when the namespace is parallel-agnostic (tp_size 1 in config.json "
    "whatever TP wrote it): the writer's TP size is a hint",
)


def recognise(path: Path) -> Recognition:
    """Whether ``path`` is a vLLM fs-tier namespace, a rank directory, a block file or a root
    holding exactly one namespace."""
    if namespace_of(path) is not None:
        return Recognition(True, "a vLLM fs-tier namespace")
    if path.is_dir():
        spaces = namespaces_under(path)
        if len(spaces) == 1:
            return Recognition(True, "a vLLM fs-tier root with one namespace")
        if spaces:
            names = ", ".join(space.name for space in spaces)
            return Recognition(
                False, f"a vLLM fs-tier root with {len(spaces)} namespaces ({names}): open one"
            )
        base, _, rank = path.name.rpartition("_r")
        if base and rank.isdigit() and NAMESPACE_DIR.search(base):
            return Recognition(
                False, f"a vLLM rank directory whose namespace {base}/config.json is missing"
            )
        return Recognition(False, "a directory without a vLLM fs-tier config.json")
    return Recognition(False, "not a vLLM fs-tier block file (<hash>.bin under <ns>_r<rank>/)")


def open_vllm_fs(path: Path, hints: Mapping[str, Any]) -> VLLMFsNamespace:
    """Open the namespace ``path`` is, belongs to, or (a root) holds; ``hints`` as for
    :class:`VLLMFsNamespace`."""
    namespace = namespace_of(path)
    only = None
    if namespace is None and path.is_dir():
        spaces = namespaces_under(path)
        if len(spaces) != 1:
            raise NotASnapshotError(recognise(path).found, file=str(path))
        namespace = spaces[0]
    if namespace is None:
        raise NotASnapshotError(recognise(path).found, file=str(path))
    if path.is_file():
        only = path
    return VLLMFsNamespace(namespace, hints, only_block=only)


class VLLMFsNamespace(ForeignSource):
    """One vLLM fs-tier namespace: its config, rank directories and block files.

    ``hints`` (all optional) supply what the files do not say: ``model`` (a directory with
    the model's transformers ``config.json``; default: ``model_name`` when that is one),
    ``num_kv_heads`` and ``head_dim`` (instead of ``model``), ``page_order`` (``cells-nhd``,
    ``cells-hnd``, a :class:`PageOrder` or a path to a probed order ``.npz``), ``tp_size``
    (the writer's TP size, for a parallel-agnostic namespace), ``rank`` (which rank directory
    to read; default the only one, else 0), ``tokens`` (a prompt's token ids: the sequence to
    find) and ``hash_seed`` (the writer's ``PYTHONHASHSEED``, if it set one).
    """

    format_name = FORMAT_NAME
    engine = "vllm"
    needs_tokens = True

    def __init__(
        self, namespace: Path, hints: Mapping[str, Any], *, only_block: Path | None = None
    ) -> None:
        super().__init__(namespace)
        self.hints = dict(hints)
        self.config_path = namespace / CONFIG_NAME
        self.fields = read_config(self.config_path)
        expected = namespace_name(self.fields)
        if namespace.name != expected:
            raise SnapshotCorruptError(
                f"config.json hashes to namespace {expected}, but its directory is "
                f"{namespace.name}: the config was edited or the directory renamed",
                file=str(self.config_path),
            )
        self.only_block = only_block
        self.rank_dirs = sorted(
            (p for p in namespace.parent.glob(f"{glob_escape(namespace.name)}_r*") if p.is_dir()),
            key=lambda p: p.name,
        )
        self._model_config = self._load_model_config()
        self._file_order: FileOrder | None = None

    @property
    def version(self) -> str:
        return f"vLLM {ENGINE_VERSION} fs tier"

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        return CANNOT_TELL

    @property
    def parallel_agnostic(self) -> bool:
        """vLLM writes ``parallel_agnostic: false`` only when the namespace is not agnostic."""
        return self.fields.get("parallel_agnostic", True) is not False

    @property
    def group(self) -> dict[str, Any]:
        """The one KV cache group kvsnap decodes (hybrid models have several)."""
        groups = self.fields["kv_cache_groups"]
        if len(groups) != 1:
            raise LayoutError(f"{len(groups)} KV cache groups: kvsnap decodes one")
        return groups[0]

    def _load_model_config(self) -> dict[str, Any] | None:
        model = self.hints.get("model")
        candidate = Path(model) if model is not None else Path(self.fields["model_name"])
        config = candidate / "config.json"
        if not config.is_file():
            if model is not None:
                raise LayoutError(f"{model}: no config.json of a model there")
            return None
        try:
            loaded = json.loads(config.read_text())
        except (OSError, ValueError) as error:
            raise LayoutError(f"{config}: cannot read the model config ({error})") from None
        return {**loaded, "_path": str(config)} if isinstance(loaded, dict) else None

    def heads(self) -> tuple[int, int] | None:
        """``(num_kv_heads, head_dim)`` from the hints or the model config, if known."""
        heads, dim = self.hints.get("num_kv_heads"), self.hints.get("head_dim")
        config = self._model_config or {}
        text = config.get("text_config", config)
        if heads is None:
            heads = text.get("num_key_value_heads", text.get("num_attention_heads"))
        if dim is None and text.get("head_dim") is not None:
            dim = text["head_dim"]
        if dim is None and text.get("hidden_size") and text.get("num_attention_heads"):
            dim = text["hidden_size"] // text["num_attention_heads"]
        if heads is None or dim is None:
            return None
        return int(heads), int(dim)

    def geometry(self) -> KVGeometry:
        heads = self.heads()
        if heads is None:
            raise LayoutError(
                f"{self.path}: the fs tier does not record the KV heads or head size and "
                f"{self.fields['model_name']} is not a local model directory: pass --model DIR "
                "(model=DIR from Python)"
            )
        group = self.group
        return KVGeometry(
            num_layers=len(group["layer_names"]),
            block_size=int(group["tokens_per_block"]),
            dtype=self.fields["dtype"],
            num_kv_heads=heads[0],
            head_dim=heads[1],
        )

    def writer_tp(self) -> int:
        """The TP size whose workers each wrote their own region of every block file."""
        hinted = self.hints.get("tp_size")
        if hinted is not None:
            if not self.parallel_agnostic and int(hinted) != self.fields["tp_size"]:
                raise LayoutError(
                    f"tp_size {hinted} given, but config.json records tp_size "
                    f"{self.fields['tp_size']}"
                )
            return int(hinted)
        return 1 if self.parallel_agnostic else int(self.fields["tp_size"])

    def block_file_size(self) -> int | None:
        """The size every block file must have, when the geometry is known."""
        try:
            geometry = self.geometry()
        except LayoutError:
            return None
        element = kv_element(geometry.dtype).size
        pages = 2 * geometry.block_size * geometry.num_kv_heads * geometry.head_dim * element
        row = geometry.num_layers * pages * int(self.fields["blocks_per_file"])
        return math.ceil(row / ROW_ALIGNMENT) * ROW_ALIGNMENT

    def block_files(self) -> list[tuple[Path, str, int]]:
        """Every block file as ``(path, hash hex, group)``, rank directories in order."""
        if self.only_block is not None:
            match = BLOCK_NAME.match(self.only_block.name)
            group = GROUP_DIR.match(self.only_block.parent.name)
            assert match is not None
            return [(self.only_block, match.group(1), int(group.group(2)) if group else 0)]
        files = []
        for rank_dir in self.rank_dirs:
            for root, _, names in os.walk(rank_dir):
                for name in sorted(names):
                    match = BLOCK_NAME.match(name)
                    group = GROUP_DIR.match(Path(root).name)
                    if match is not None:
                        files.append(
                            (
                                Path(root) / name,
                                match.group(1),
                                int(group.group(2)) if group else -1,
                            )
                        )
        return files

    def verify(self) -> list[ForeignProblem]:
        # A namespace without rank directories is a tier that has stored nothing yet
        # (notes() says so): vLLM writes config.json at start and <ns>_r0 at its first store.
        problems: list[ForeignProblem] = []
        size = self.block_file_size()
        sizes: dict[int, int] = {}
        groups = len(self.fields["kv_cache_groups"])
        for path, digest, group in self.block_files():
            problems += placement_problems(path, digest, group, groups)
            try:
                actual = path.stat().st_size
            except OSError as error:
                problems.append(ForeignProblem(str(path), f"cannot stat: {error.strerror}"))
                continue
            sizes[actual] = sizes.get(actual, 0) + 1
            if size is not None and actual != size:
                problems.append(
                    ForeignProblem(
                        str(path), f"{actual} bytes, a block file of this namespace has {size}"
                    )
                )
            elif actual == 0 or actual % ROW_ALIGNMENT:
                problems.append(
                    ForeignProblem(str(path), f"{actual} bytes, not a multiple of {ROW_ALIGNMENT}")
                )
        if size is None and len(sizes) > 1:
            problems.append(
                ForeignProblem(str(self.path), f"block files of several sizes: {sorted(sizes)}")
            )
        for rank_dir in self.rank_dirs:
            for leftover in rank_dir.rglob("*.tmp"):
                problems.append(
                    ForeignProblem(str(leftover), "a temporary file of an interrupted write")
                )
        return problems

    def describe(self) -> dict[str, Any]:
        files = self.block_files()
        heads = self.heads()
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "path": str(self.path),
            "config": dict(self.fields),
            "namespace_hash": namespace_digest(self.fields),
            "parallel_agnostic": self.parallel_agnostic,
            "rank_dirs": [p.name for p in self.rank_dirs],
            "num_block_files": len(files),
            "block_file_bytes": self.block_file_size(),
            "total_bytes": sum(p.stat().st_size for p, _, _ in files if p.exists()),
            "model_config": None if self._model_config is None else self._model_config["_path"],
            "num_kv_heads": None if heads is None else heads[0],
            "head_dim": None if heads is None else heads[1],
            "blocks": [
                {"hash": digest, "group": group, "file": str(p)}
                for p, digest, group in files[:1000]
            ],
            "cannot_tell": list(CANNOT_TELL),
        }

    def sequences(self) -> list[ForeignSequence]:
        tokens = self.hints.get("tokens")
        if tokens is None:
            return []
        group = self.group
        block_size = int(group["tokens_per_block"])
        if self.fields["blocks_per_file"] != 1 or self.fields["tokens_per_hash"] != block_size:
            raise LayoutError(
                "finding a prompt's blocks needs blocks_per_file 1 and tokens_per_hash equal to "
                f"the block size; this namespace has {self.fields['blocks_per_file']} and "
                f"{self.fields['tokens_per_hash']} (block size {block_size})"
            )
        seed = str(self.hints.get("hash_seed") or DEFAULT_HASH_SEED)
        found = []
        for digest in prefix_hashes(tokens, block_size, seed):
            if not self._block_path(digest.hex()).is_file():
                break
            found.append(digest.hex())
        ids = np.asarray(tokens[: len(found) * block_size], dtype=np.int64)
        return [ForeignSequence("prompt", ids, tuple(found))]

    def _rank_dir(self) -> Path:
        rank = self.hints.get("rank")
        if rank is None and len(self.rank_dirs) == 1:
            return self.rank_dirs[0]
        wanted = self.path.with_name(f"{self.path.name}_r{int(rank or 0)}")
        if wanted not in self.rank_dirs:
            raise LayoutError(f"{wanted}: no such rank directory")
        return wanted

    def _block_path(self, digest: str, group: int = 0) -> Path:
        return block_path(self._rank_dir(), digest, group)

    def page_order(self, local_heads: int) -> PageOrder:
        """The order that decodes one worker's page (``local_heads`` heads)."""
        geometry = self.geometry()
        order = self.hints.get("page_order")
        if order is None:
            raise LayoutError(
                f"{self.path}: the fs tier does not record how the engine laid out its pages: "
                f"pass a page order ({', '.join(CELL_ORDERS)}, or a probed order file)"
            )
        if isinstance(order, str) and order in CELL_ORDERS:
            order = cell_order(order, geometry.block_size, local_heads, geometry.head_dim)
        elif not isinstance(order, PageOrder):
            order = load_page_order(Path(order))
        if order.shape != (geometry.block_size, local_heads, geometry.head_dim):
            raise LayoutError(self._order_mismatch(order.shape, local_heads))
        return order

    def _order_mismatch(self, shape: tuple[int, int, int], local_heads: int) -> str:
        """Why a page order does not fit, naming the TP size its head count reveals."""
        geometry = self.geometry()
        wanted = (geometry.block_size, local_heads, geometry.head_dim)
        message = (
            f"the page order is for pages of {shape} (tokens, heads, dims), each worker here "
            f"holds {wanted}"
        )
        block, heads, dim = shape
        if (block, dim) != (wanted[0], wanted[2]) or geometry.num_kv_heads % heads:
            return message
        implied = geometry.num_kv_heads // heads
        given = self.hints.get("tp_size")
        if given is None:
            return (
                f"{message}: its pages hold the heads of a TP {implied} writer, and TP "
                f"{self.writer_tp()} was assumed (this namespace does not record it): pass "
                f"--tp {implied} if the files are a TP {implied} engine's"
            )
        return f"{message}: its pages are a TP {implied} writer's, not TP {given}'s"

    def notes(self) -> list[str]:
        notes = []
        if not self.rank_dirs:
            notes.append(
                "no block stored yet: vLLM creates the rank directory (<ns>_r0) at its first "
                "store, so a freshly started tier has only config.json"
            )
        decoded = self._file_order is not None
        if decoded and self.parallel_agnostic and self.hints.get("tp_size") is None:
            notes.append(
                "TP 1 assumed: this namespace is parallel-agnostic and does not record the "
                "writer's TP size; files a TP N engine wrote decode right only with --tp N "
                "(a wrong TP gives wrong KV, which nothing in the files shows)"
            )
        return notes

    def read_block(self, block_id: str) -> ForeignBlock:
        for field in ("canonical_format", "replicated_layout"):
            if field in self.fields:
                raise LayoutError(
                    f"{self.path}: a namespace with {field} {self.fields[field]!r}: kvsnap "
                    "decodes vLLM's direct (per-worker) layout only"
                )
        pages = int(self.fields["blocks_per_file"])
        if pages != 1:
            raise LayoutError(f"blocks_per_file {pages}: kvsnap decodes one block per file")
        geometry = self.geometry()
        order = self.file_order()
        path = self._block_path(block_id)
        expected = self.block_file_size()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotCorruptError("no such block file", file=str(path)) from None
        except OSError as error:
            raise SnapshotIOError(
                f"cannot read: {error.strerror or error}", file=str(path)
            ) from None
        if len(data) != expected:
            raise SnapshotCorruptError(
                f"{len(data)} bytes, a block file here has {expected}", file=str(path)
            )
        keys, values = decode_bytes(data, torch_dtype(geometry.dtype), order)
        return ForeignBlock(block_id, tuple(keys.unbind(0)), tuple(values.unbind(0)))

    def file_order(self) -> FileOrder:
        """Where every key and value element of a block file lies, built once per namespace:
        a row is each worker's region in rank order, a region its layers' pages in order."""
        if self._file_order is None:
            geometry = self.geometry()
            tp = self.writer_tp()
            if geometry.num_kv_heads % tp:
                raise LayoutError(f"{geometry.num_kv_heads} KV heads do not split over TP {tp}")
            order = self.page_order(geometry.num_kv_heads // tp)
            layers, page = geometry.num_layers, order.elements
            starts = [[(w * layers + layer) * page for w in range(tp)] for layer in range(layers)]
            self._file_order = tile_pages(order, starts)
        return self._file_order


VLLM_FS = ForeignFormat(
    name=FORMAT_NAME,
    reads=f"vLLM {ENGINE_VERSION} fs offloading tier (namespace, rank directory or block file)",
    recognise=recognise,
    open=open_vllm_fs,
    hints=(
        "model",
        "num_kv_heads",
        "head_dim",
        "page_order",
        "tp_size",
        "rank",
        "tokens",
        "hash_seed",
    ),
)
