"""What the scheduler tells the workers each step: :class:`LoadSpec`, :class:`SaveSpec`.

:class:`KVSnapConnectorMetadata` carries one step's loads (before the forward pass) and saves
(after it) from the scheduler process to every worker. Nothing here needs vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from kvsnap.engines.vllm.compat import KVConnectorMetadata

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(request_id: str) -> str:
    """The id a client gave vLLM: vLLM appends ``-`` and 8 hex digits to make its internal id."""
    return _INTERNAL_SUFFIX.sub("", request_id)


@dataclass(frozen=True)
class LoadSpec:
    """Load snapshot blocks ``snapshot_blocks`` of ``path`` into engine blocks ``target_blocks``."""

    request_id: str
    path: str
    sequence_id: str
    snapshot_blocks: np.ndarray
    target_blocks: np.ndarray
    num_tokens: int


@dataclass(frozen=True)
class SaveSpec:
    """Capture engine blocks ``block_ids`` holding ``token_ids`` into a snapshot at ``path``.

    ``kind`` is ``persist`` (a prefix for the store; ``chain`` its prefix hashes, indexed once
    the file is published) or ``dump``. ``replace`` overwrites a stored snapshot that failed
    to load (otherwise an existing one is kept).
    """

    request_id: str
    kind: str
    path: str
    token_ids: np.ndarray
    block_ids: np.ndarray
    chain: tuple[str, ...] = ()
    replace: bool = False


@dataclass
class KVSnapConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step: loads before it, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
