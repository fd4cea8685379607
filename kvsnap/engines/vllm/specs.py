"""What the scheduler tells the workers each step (:class:`LoadSpec`, :class:`SaveSpec`), and
what the workers tell it back (:class:`KVSnapWorkerMetadata`).

:class:`KVSnapConnectorMetadata` carries one step's loads (before the forward pass) and saves
(after it) from the scheduler process to every worker; :class:`KVSnapWorkerMetadata` carries
back which requests' loads ran in that step, so the scheduler learns every load's outcome
(the blocks that failed come in the same step's ``invalid_block_ids``). Nothing here needs
vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from kvsnap import format as fmt
from kvsnap.engines.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(request_id: str) -> str:
    """The id a client gave vLLM: vLLM appends ``-`` and 8 hex digits to make its internal id."""
    return _INTERNAL_SUFFIX.sub("", request_id)


@dataclass(frozen=True)
class ChunkLoad:
    """Load blocks ``snapshot_blocks`` of the chunk ``path`` into engine ``target_blocks``.

    ``checked`` is the chunk's one sequence as the scheduler checked it against the request:
    its id names the span and the store keys under the request's identity, its token ids are
    the prompt's, its block ids are those ``snapshot_blocks`` were taken from. The worker loads
    the chunk only from a file that holds that very sequence: anything else found under the
    name by the time it loads (a file renamed over it since the check) is a miss.
    """

    path: str
    snapshot_blocks: np.ndarray
    target_blocks: np.ndarray
    checked: fmt.SequenceRecord


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: consecutive stored ``chunks``, ``num_tokens`` in all."""

    request_id: str
    chunks: tuple[ChunkLoad, ...]
    num_tokens: int

    @property
    def target_blocks(self) -> np.ndarray:
        """Every engine block the load writes, in prompt order."""
        return np.concatenate([chunk.target_blocks for chunk in self.chunks])


@dataclass(frozen=True)
class SaveSpec:
    """Capture engine blocks ``block_ids`` holding ``token_ids`` into a snapshot at ``path``.

    ``kind`` is ``persist`` (a chunk of the prefix store, skipped if it exists by the time it
    is written) or ``dump``; ``sequence_id`` names the snapshot's one sequence.
    """

    request_id: str
    kind: str
    path: str
    token_ids: np.ndarray
    block_ids: np.ndarray
    sequence_id: str


@dataclass
class KVSnapConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step: loads before it, saves after it,
    and the ``preempted`` requests with saves (their blocks were freed: the worker waits for
    their copies before the forward pass)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KVSnapWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers report to the scheduler for one step: the requests whose planned
    loads ran in it (whether or not they failed; a failure's blocks are in the same step's
    ``invalid_block_ids``). vLLM aggregates the reports of every TP rank with
    :meth:`aggregate`."""

    loaded: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVSnapWorkerMetadata:
        """The union of two ranks' reports of the same step."""
        assert isinstance(other, KVSnapWorkerMetadata)
        return KVSnapWorkerMetadata(self.loaded | other.loaded)
