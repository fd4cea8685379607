"""Compare two snapshots' KV, streaming: :func:`compare` reads both a bounded step at a time
(the next step read while this one is reduced) and folds every step into per-tensor, per-head
numbers (:mod:`kvsnap.analysis.diff_kernel`), whatever the snapshots' size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvsnap import format as fmt
from kvsnap.analysis.comparison import Comparison, DiffProfile, LayerDifference
from kvsnap.analysis.diff_kernel import Piece, TensorDiff, TopDifferences
from kvsnap.analysis.pairing import (
    SequencePair,
    geometry_problem,
    layout_notes,
    pair_sequences,
    source_differences,
)
from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.analysis.reads import (
    LANES,
    BlockSource,
    ByteCounter,
    in_lanes,
    prefetched,
    token_blocks,
    tokens_per_step,
)
from kvsnap.analysis.values import compute_dtype, decoder

#: ``progress(done_bytes, total_bytes)``: bytes of stored KV read, of both snapshots.
Progress = Callable[[int, int], None]
#: Token bins of a profile (``kvsnap diff --plot``): a longer sequence is binned.
PROFILE_BINS = 1024
#: Elements of one side a reduction works on at once: a step is reduced a piece of this size
#: at a time, so that its decoded values, their difference and the flags (about 1.6 MiB) stay
#: in a core's cache through the ten passes over them, instead of streaming from memory.
PIECE_ELEMENTS = 1 << 17


def compare(
    a: ReadableSnapshot,
    b: ReadableSnapshot,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    top: int = 10,
    profile: bool = False,
    profile_sequence: str | None = None,
    progress: Progress | None = None,
) -> Comparison:
    """Compare snapshot ``a``'s KV with reference ``b``, reading both once, in bounded memory.

    The layers, KV heads and head size (or MLA latent width) must match (otherwise the only
    problem names the differing fields, and nothing is read); the dtype and the block size
    may differ. Sequences are paired by id, by position when no id is in both (a note says
    so); a sequence only in one snapshot, a different count, length or token ids is one
    problem each. Paired sequences are compared token by token over the tokens both hold, in
    float32 (float64 when either is float64). An element is beyond the tolerance when
    ``|a - b| > atol + rtol * |b|``, or when it is NaN or Inf in one snapshot and not the same
    in the other. ``top`` largest differences are kept. With ``profile`` (or a
    ``profile_sequence``, a sequence id of ``a``; default the first pair holding tokens) one
    sequence's per-token errors are kept for a picture.
    """
    paths = (a.path, b.path)
    problem = geometry_problem(a, b)
    sources = source_differences(a, b)
    if problem is not None:
        return Comparison(False, [], [problem], sources=sources, paths=paths)
    pairs, problems, notes = pair_sequences(a, b)
    notes = layout_notes(a, b, atol, rtol) + notes
    if not pairs:
        problems.append(fmt.Problem(None, None, "the snapshots share no sequence"))
        return Comparison(False, [], problems, notes, sources, paths=paths)
    wanted = profile or profile_sequence is not None
    run = _Run(a, b, pairs, atol, rtol, top, _profiled(pairs, profile_sequence) if wanted else None)
    layers = run.layers(progress)
    ok = not problems and all(layer.num_mismatches == 0 for layer in layers)
    return Comparison(
        ok,
        layers,
        problems,
        notes,
        sources,
        run.top.entries,
        atol,
        rtol,
        paths,
        run.profile(),
    )


def _profiled(pairs: list[SequencePair], sequence_id: str | None) -> int:
    """The index of the pair a profile is kept for: ``sequence_id``'s (an id of ``a``), else
    the first pair holding tokens."""
    if sequence_id is not None:
        for index, (mine, _) in enumerate(pairs):
            if mine.id == sequence_id:
                return index
        known = ", ".join(repr(mine.id) for mine, _ in pairs[:8])
        raise KeyError(f"no compared sequence {sequence_id!r} (compared: {known})")
    for index, (mine, theirs) in enumerate(pairs):
        if min(len(mine.token_ids), len(theirs.token_ids)):
            return index
    return 0


@dataclass(frozen=True)
class _Step:
    tensor: str
    pair: int
    start: int
    stop: int


class _Run:
    """One comparison: what every lane shares (the pairs, the tolerance, the step and piece
    sizes, the profile), the tensors split over the lanes, and their results put together."""

    def __init__(
        self,
        a: ReadableSnapshot,
        b: ReadableSnapshot,
        pairs: list[SequencePair],
        atol: float,
        rtol: float,
        top: int,
        profiled: int | None,
    ) -> None:
        self.snapshots = (a, b)
        self.pairs = pairs
        self.atol, self.rtol = atol, rtol
        self.count = top
        self.top = TopDifferences(top)
        self.dtype = compute_dtype(a.geometry.dtype, b.geometry.dtype)
        geometry = a.geometry
        self.names = geometry.tensor_names()
        heads = 1 if geometry.is_mla else geometry.num_kv_heads
        dim = geometry.latent_dim if geometry.is_mla else geometry.head_dim
        self.shape = (heads, dim)
        sources = (BlockSource(a), BlockSource(b))
        self.token_bytes = [source.token_bytes for source in sources]
        self.step_tokens = tokens_per_step(
            max(self.token_bytes), a.geometry.block_size, b.geometry.block_size
        )
        self.piece_tokens = max(1, PIECE_ELEMENTS // (heads * dim))
        self.profiled = profiled
        self.bins = _bin_starts(0 if profiled is None else _pair_tokens(pairs[profiled]))
        layers, bins = geometry.num_layers, len(self.bins)
        self.profile_values = {
            part: np.zeros((layers, bins, heads))
            for part in (geometry.parts if profiled is not None else ())
        }

    def steps(self, names: list[str]) -> list[_Step]:
        steps = []
        for tensor in names:
            for index, pair in enumerate(self.pairs):
                count = _pair_tokens(pair)
                for start in range(0, count, self.step_tokens):
                    steps.append(_Step(tensor, index, start, min(count, start + self.step_tokens)))
        return steps

    def layers(self, progress: Progress | None) -> list[LayerDifference]:
        """Every tensor's result: the tensors split over the lanes, which run at once."""
        total = sum(step.stop - step.start for step in self.steps(self.names)) * sum(
            self.token_bytes
        )
        counter = ByteCounter(total, progress)
        lanes = [_Lane(self, self.names[lane::LANES]) for lane in range(LANES)]
        results = in_lanes([lane.run for lane in lanes], counter)
        tensors = {name: diff for lane_result in results for name, diff in lane_result.items()}
        entries = sorted(
            (entry for lane in lanes for entry in lane.top.entries),
            key=lambda location: location.abs_diff,
            reverse=True,
        )
        self.top.entries = entries[: self.count]
        return [
            tensors[name].result() if name in tensors else _empty(name, self.shape[0])
            for name in self.names
        ]

    def add_profile(self, tensor: str, start: int, stop: int, relative: np.ndarray) -> None:
        """Fold a piece's vector relative errors into the profile (each tensor is one lane's:
        lanes write rows of their own)."""
        layer, part = tensor.split(".")[1:]
        tokens = np.arange(start, stop)
        bins = np.searchsorted(self.bins, tokens, side="right") - 1
        firsts = np.flatnonzero(np.diff(bins, prepend=-1))
        # np.maximum keeps NaN: a bin holding a NaN or Inf vector stays marked.
        largest = np.maximum.reduceat(relative, firsts, axis=0)
        row = self.profile_values[part][int(layer)]
        row[bins[firsts]] = np.maximum(row[bins[firsts]], largest)

    def profile(self) -> DiffProfile | None:
        if self.profiled is None:
            return None
        pair = self.pairs[self.profiled]
        if not _pair_tokens(pair):
            return None
        return DiffProfile(pair[0].id, _pair_tokens(pair), self.bins, self.profile_values)


class _Lane:
    """The tensors one thread compares, step by step, with buffers and readers of its own (two
    raw buffers per snapshot, one decoded piece of each and their difference)."""

    def __init__(self, run: _Run, names: list[str]) -> None:
        self.shared, self.names = run, names
        self.sources = tuple(BlockSource(snapshot) for snapshot in run.snapshots)
        self.decoders = [decoder(s.geometry.dtype, run.dtype) for s in self.sources]
        self.top = TopDifferences(run.count)
        self.raw = [
            [np.empty(self._raw_bytes(source), dtype=np.uint8) for _ in range(2)]
            for source in self.sources
        ]
        heads, dim = run.shape
        elements = min(run.step_tokens, run.piece_tokens) * heads * dim
        self.work = [np.empty(elements, dtype=run.dtype) for _ in range(3)]

    def _raw_bytes(self, source: BlockSource) -> int:
        return (self.shared.step_tokens // source.block_size + 1) * source.page_bytes

    def _start(self, step: _Step, slot: int) -> Callable[[], None]:
        waits = []
        for side, source in enumerate(self.sources):
            record = self.shared.pairs[step.pair][side]
            blocks = token_blocks(record, source.block_size, step.start, step.stop)
            waits.append(source.start(step.tensor, blocks, self.raw[side][slot], slot))

        def wait_both() -> None:
            for wait in waits:
                wait()

        return wait_both

    def run(self, advance: Callable[[int], bool]) -> dict[str, TensorDiff]:
        """Compare this lane's tensors; ``advance(bytes)`` counts progress and says whether
        to go on (another lane failed: stop)."""
        run = self.shared
        tensors: dict[str, TensorDiff] = {}
        for number, (step, _) in enumerate(prefetched(run.steps(self.names), self._start)):
            diff = tensors.get(step.tensor)
            if diff is None:
                diff = TensorDiff(step.tensor, *run.shape, run.atol, run.rtol, self.top)
                tensors[step.tensor] = diff
            for first in range(step.start, step.stop, run.piece_tokens):
                last = min(step.stop, first + run.piece_tokens)
                relative = diff.add(self._piece(step, number % 2, first, last))
                if step.pair == run.profiled:
                    run.add_profile(step.tensor, first, last, relative)
            if not advance((step.stop - step.start) * sum(run.token_bytes)):
                break
        return tensors

    def _piece(self, step: _Step, slot: int, first: int, last: int) -> Piece:
        """Tokens ``[first, last)`` of ``step`` (read into buffer ``slot``), decoded."""
        count = last - first
        shape = (count, *self.shared.shape)
        size = count * self.shared.shape[0] * self.shared.shape[1]
        decoded = []
        for side, source in enumerate(self.sources):
            offset = (first - step.start) * source.token_bytes
            raw = self.raw[side][slot][offset : offset + count * source.token_bytes]
            out = self.work[side][:size]
            self.decoders[side](raw, out)
            decoded.append(out.reshape(shape))
        sequence = self.shared.pairs[step.pair][0].id
        scratch = self.work[2][:size].reshape(shape)
        return Piece(step.tensor, sequence, first, decoded[0], decoded[1], scratch)


def _pair_tokens(pair: SequencePair) -> int:
    return min(len(pair[0].token_ids), len(pair[1].token_ids))


def _bin_starts(count: int) -> np.ndarray:
    bins = max(1, min(count, PROFILE_BINS))
    return (np.arange(bins, dtype=np.int64) * count) // bins


def _empty(name: str, heads: int) -> LayerDifference:
    """A tensor no token was compared in (every paired sequence empty)."""
    return LayerDifference(name, 0.0, 0, None)
