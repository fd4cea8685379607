"""Per-tensor statistics of a snapshot's real tokens, streaming: every layer tensor is read a
bounded step at a time (the next step read while this one is reduced), so ``kvsnap inspect
--stats`` runs in the same memory for a 1 MB and a 100 GB snapshot.

Each step's statistics are merged into the running ones with the pairwise update of Chan,
Golub and LeVeque (counts, means and sums of squared deviations), which stays exact where a
running sum of squares would cancel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.analysis.reads import (
    LANES,
    STEP_BYTES,
    BlockSource,
    ByteCounter,
    in_lanes,
    prefetched,
)
from kvsnap.analysis.values import compute_dtype, decoder

#: ``progress(done_bytes, total_bytes)``: bytes of stored KV read.
Progress = Callable[[int, int], None]


def valid_tokens_per_block(snapshot: ReadableSnapshot) -> np.ndarray:
    """How many leading tokens of each snapshot block hold real KV (partial last blocks; a
    block no sequence references counts 0)."""
    valid = np.zeros(snapshot.num_blocks, dtype=np.int64)
    block_size = snapshot.geometry.block_size
    for record in snapshot.sequences:
        if len(record.block_ids) == 0:  # a sequence without tokens holds no block
            continue
        counts = np.full(len(record.block_ids), block_size, dtype=np.int64)
        counts[-1] = len(record.token_ids) - block_size * (len(record.block_ids) - 1)
        np.maximum.at(valid, np.asarray(record.block_ids, dtype=np.int64), counts)
    return valid


@dataclass
class _Running:
    """Count, mean and sum of squared deviations of the finite values; absmax; NaN, Inf."""

    count: int = 0
    mean: float = 0.0
    squares: float = 0.0
    absmax: float = 0.0
    nan: int = 0
    inf: int = 0

    def add(self, values: np.ndarray, scratch: np.ndarray) -> None:
        total = float(np.add.reduce(values, dtype=values.dtype))
        if not np.isfinite(total):
            finite = np.isfinite(values)
            nan = int(np.isnan(values).sum())
            self.nan += nan
            self.inf += int(values.size - finite.sum()) - nan
            values = values[finite]
            total = float(np.add.reduce(values, dtype=np.float64))
        count = values.size
        if not count:
            return
        mean = total / count
        centred = np.subtract(values, mean, out=scratch[:count])
        squares = float(np.dot(centred, centred))
        self.absmax = max(self.absmax, float(values.max()), -float(values.min()))
        merged = self.count + count
        delta = mean - self.mean
        self.squares += squares + delta * delta * self.count * count / merged
        self.mean += delta * count / merged
        self.count = merged

    def result(self) -> dict[str, float | int]:
        std = (self.squares / self.count) ** 0.5 if self.count else 0.0
        return {
            "absmax": self.absmax,
            "mean": self.mean if self.count else 0.0,
            "std": std,
            "nan": self.nan,
            "inf": self.inf,
        }


def snapshot_stats(
    snapshot: ReadableSnapshot,
    names: Sequence[str] | None = None,
    *,
    progress: Progress | None = None,
) -> dict[str, dict[str, float | int]]:
    """Per layer tensor (``names``, default every one): absmax, mean, std (population), NaN
    and Inf counts over the tokens that hold real KV (mean and std of the finite values; all
    zero when no token does). Reads each block holding real KV once, a bounded step at a
    time, the tensors split over :data:`~kvsnap.analysis.reads.LANES` threads; ``progress``
    gets the bytes read."""
    valid = valid_tokens_per_block(snapshot)
    used = np.flatnonzero(valid).astype(np.int64)
    chosen = list(snapshot.geometry.tensor_names() if names is None else names)
    page_bytes = BlockSource(snapshot).page_bytes
    counter = ByteCounter(len(used) * page_bytes * len(chosen), progress)
    lanes = [_StatsLane(snapshot, chosen[lane::LANES], used, valid) for lane in range(LANES)]
    results = in_lanes([lane.run for lane in lanes if lane.names], counter)
    running = {name: stats for result in results for name, stats in result.items()}
    return {name: running[name].result() for name in chosen}


class _StatsLane:
    """The tensors one thread measures, with a reader and buffers of its own."""

    def __init__(
        self, snapshot: ReadableSnapshot, names: list[str], used: np.ndarray, valid: np.ndarray
    ) -> None:
        self.names, self.used, self.valid = names, used, valid
        self.source = source = BlockSource(snapshot)
        self.per_step = max(1, STEP_BYTES // source.page_bytes)
        dtype = compute_dtype(snapshot.geometry.dtype)
        self.decode = decoder(snapshot.geometry.dtype, dtype)
        self.raw = [np.empty(self.per_step * source.page_bytes, dtype=np.uint8) for _ in range(2)]
        elements = self.per_step * source.page_bytes // source.element_size
        self.values, self.scratch = np.empty(elements, dtype=dtype), np.empty(elements, dtype)

    def _start(self, step: tuple[str, np.ndarray], slot: int) -> Callable[[], None]:
        return self.source.start(step[0], step[1], self.raw[slot], slot)

    def run(self, advance: Callable[[int], bool]) -> dict[str, _Running]:
        """Measure this lane's tensors; ``advance(bytes)`` counts progress and says whether to
        go on."""
        source, used = self.source, self.used
        steps = [
            (name, used[start : start + self.per_step])
            for name in self.names
            for start in range(0, len(used), self.per_step)
        ]
        running = {name: _Running() for name in self.names}
        for number, ((name, blocks), _) in enumerate(prefetched(steps, self._start)):
            size = len(blocks) * source.page_bytes
            decoded = self.values[: size // source.element_size]
            self.decode(self.raw[number % 2][:size], decoded)
            running[name].add(_real_tokens(decoded, self.valid[blocks], source), self.scratch)
            if not advance(size):
                break
        return running


def _real_tokens(decoded: np.ndarray, valid: np.ndarray, source: BlockSource) -> np.ndarray:
    """The values of ``decoded`` blocks' real tokens (all of a full block, the first
    ``valid`` of a partial one), as one flat array."""
    if (valid == source.block_size).all():
        return decoded
    per_token = source.heads * source.dim
    tokens = decoded.reshape(len(valid) * source.block_size, per_token)
    keep = (np.arange(source.block_size)[None, :] < valid[:, None]).reshape(-1)
    return tokens[keep].reshape(-1)


def tensor_stats(snapshot: ReadableSnapshot, name: str) -> dict[str, float | int]:
    """absmax, mean, std (population), NaN and Inf counts of tensor ``name`` over the tokens
    that hold real KV; all zero when there is no such token (:func:`snapshot_stats`)."""
    return snapshot_stats(snapshot, [name])[name]
