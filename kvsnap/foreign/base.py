"""What every foreign-format reader gives: the opened source, its problems, its blocks.

A reader module (one per format) defines a :class:`ForeignFormat`: a name, ``recognise(path)``
(cheap: a look at names and a few bytes) and ``open(path, hints)``. What it opens is a
:class:`ForeignSource`: the format's metadata, a structural ``verify()``, the sequences it can
name and their blocks as canonical pages, and a plain list of what the format cannot tell.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap.layout import KVGeometry

if TYPE_CHECKING:  # blocks hold tensors; recognising, describing and verifying need no torch
    import torch


@dataclass(frozen=True)
class Recognition:
    """A reader's verdict on a path: ``matches``, and in words what it found there."""

    matches: bool
    found: str


@dataclass(frozen=True)
class ForeignProblem:
    """One structural problem: the file (or directory) it is in, and what is wrong."""

    file: str
    message: str

    def as_dict(self) -> dict[str, str]:
        """The problem as ``{"file", "message"}``."""
        return {"file": self.file, "message": self.message}


@dataclass(frozen=True)
class ForeignSequence:
    """A run of blocks the format holds for one token sequence, in order.

    ``token_ids`` covers exactly the tokens of ``block_ids`` (the last block may be partial
    only where the format keeps partial blocks); ``block_ids`` are the reader's own block
    names (a vLLM block hash, a llama.cpp cell range).
    """

    id: str
    token_ids: np.ndarray
    block_ids: tuple[str, ...]


@dataclass(frozen=True)
class ForeignBlock:
    """One block as canonical pages: per layer a key and a value tensor of shape
    ``(block_size, num_kv_heads, head_dim)`` in the format's dtype; for MLA, ``keys`` are the
    latents ``(block_size, latent_dim)`` and ``values`` is empty."""

    id: str
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


class ForeignSource(ABC):
    """One opened foreign store or file. Subclasses fill in the format's specifics."""

    #: The format's registry name (``vllm-fs``, ``llama-state``).
    format_name: str = ""
    #: The engine that writes it, as a converted snapshot's ``source.engine`` names it.
    engine: str = "unknown"
    #: Whether sequences are found only from a prompt's token ids (the ``tokens`` hint).
    needs_tokens: bool = False

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    @abstractmethod
    def version(self) -> str:
        """The format version (and the engine version it was read against)."""

    @property
    @abstractmethod
    def cannot_tell(self) -> tuple[str, ...]:
        """What the format does not record, each as one sentence, for people and ``--json``."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Everything the format records about itself, as a JSON-able dict."""

    @abstractmethod
    def verify(self) -> list[ForeignProblem]:
        """Structural problems (names, sizes, counts, hashes the format has); ``[]`` if none.
        Contents cannot be checked beyond what the format itself records."""

    @abstractmethod
    def geometry(self) -> KVGeometry:
        """The KV geometry of the blocks; :class:`~kvsnap.layout.LayoutError` when the files
        alone do not fix it and no hint was given."""

    @abstractmethod
    def sequences(self) -> list[ForeignSequence]:
        """The sequences this source can name with their token ids."""

    @abstractmethod
    def read_block(self, block_id: str) -> ForeignBlock:
        """One block's KV as canonical pages."""

    def notes(self) -> list[str]:
        """What a reader assumed or found worth saying that is not a problem (an empty store, a
        hint's default taken), one sentence each; ``[]`` when there is nothing to say."""
        return []

    def close(self) -> None:
        """Release what the reader holds (nothing, for readers that open files per read)."""
        return None

    def __enter__(self) -> ForeignSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ForeignFormat:
    """A registered reader: its name, what it reads, and its two entry points."""

    name: str
    reads: str
    recognise: Callable[[Path], Recognition]
    open: Callable[[Path, Mapping[str, Any]], ForeignSource]
    hints: tuple[str, ...] = field(default=())
