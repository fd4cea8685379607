"""The torch backend's views: copy runs folded into strided views of raw bytes.

Each :class:`~kvsnap.layout.PageRef`'s copy runs are folded into as few strided views as their
regularity allows (``(num_blocks, num_runs, num_fragments, fragment_words)``: one view for an NHD
page, one for all heads of the packed layout), moved in the widest word every offset allows.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvsnap.layout import CopyRun, PageRef


def host_bytes(address: int, num_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over ``num_bytes`` of host memory at ``address`` (no copy, not owned)."""
    return torch.frombuffer((ctypes.c_uint8 * num_bytes).from_address(address), dtype=torch.uint8)


def nonnegative_runs(run: CopyRun) -> list[CopyRun]:
    """``run`` rewritten with non-negative strides (``as_strided`` rejects negative ones).

    A single fragment takes any stride; a run with both strides negative is walked backwards;
    a run whose strides have opposite signs is split into single fragments.
    """
    if run.num_fragments == 1:
        return [
            CopyRun(
                run.local_offset,
                run.fragment_size,
                run.canonical_offset,
                run.fragment_size,
                run.fragment_size,
                1,
            )
        ]
    if run.local_stride >= 0 and run.canonical_stride >= 0:
        return [run]
    last = run.num_fragments - 1
    if run.local_stride <= 0 and run.canonical_stride <= 0:
        return [
            CopyRun(
                run.local_offset + last * run.local_stride,
                -run.local_stride,
                run.canonical_offset + last * run.canonical_stride,
                -run.canonical_stride,
                run.fragment_size,
                run.num_fragments,
            )
        ]
    return [
        CopyRun(
            run.local_offset + i * run.local_stride,
            run.fragment_size,
            run.canonical_offset + i * run.canonical_stride,
            run.fragment_size,
            run.fragment_size,
            1,
        )
        for i in range(run.num_fragments)
    ]


def fold_runs(runs: list[CopyRun]) -> list[list[CopyRun]]:
    """Consecutive runs of one shape at equally spaced, increasing offsets, grouped.

    Each group is one strided view ``(num_runs, num_fragments, fragment)`` on both sides: the
    packed layout's one run per head becomes one group, so a copy costs one gather, not one
    per head. Runs that do not continue the progression start a new group.
    """
    groups: list[list[CopyRun]] = []
    for run in runs:
        if groups:
            group = groups[-1]
            first, last = group[0], group[-1]
            shape = (first.local_stride, first.canonical_stride)
            shape += (first.fragment_size, first.num_fragments)
            local_step = run.local_offset - last.local_offset
            canonical_step = run.canonical_offset - last.canonical_offset
            same_shape = shape == (
                run.local_stride,
                run.canonical_stride,
                run.fragment_size,
                run.num_fragments,
            )
            if len(group) == 1:
                continues = local_step > 0 and canonical_step > 0
            else:
                continues = (local_step, canonical_step) == (
                    group[1].local_offset - first.local_offset,
                    group[1].canonical_offset - first.canonical_offset,
                )
            if same_shape and continues:
                group.append(run)
                continue
        groups.append([run])
    return groups


def ref_word_bytes(ref: PageRef, runs: list[CopyRun], base_offset: int, block_stride: int) -> int:
    """The widest word (8/4/2/1 bytes) dividing every offset, stride and size of ``ref``'s runs.

    ``base_offset`` is the cache tensor's start within its storage. Moving words instead of
    bytes makes the device-side gathers run at memory speed rather than a byte per thread.
    """
    values = [base_offset, block_stride, ref.mapping.canonical_page_size_bytes]
    for run in runs:
        values += [run.local_offset, run.local_stride, run.canonical_offset]
        values += [run.canonical_stride, run.fragment_size]
    combined = 0
    for value in values:
        combined |= value
    lowest_bit = combined & -combined if combined else 8
    return min(lowest_bit, 8)


@dataclass(frozen=True)
class RunGroup:
    """Folded copy runs as one strided device view and the matching canonical-page view.

    ``device_view`` is ``(num_blocks, num_runs, num_fragments, fragment_words)`` over the cache
    tensor's storage; the canonical side is given in words from the page start.
    """

    device_view: torch.Tensor
    canonical_offset: int
    run_stride: int
    fragment_stride: int
    fills_page: bool

    def page_view(self, pages: torch.Tensor) -> torch.Tensor:
        """The group's words inside ``pages``, canonical pages as a ``(count, page_words)``."""
        _, num_runs, num_fragments, fragment_words = self.device_view.shape
        return pages.as_strided(
            (pages.shape[0], num_runs, num_fragments, fragment_words),
            (pages.stride(0), self.run_stride, self.fragment_stride, 1),
            pages.storage_offset() + self.canonical_offset,
        )
