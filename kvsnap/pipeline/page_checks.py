"""What a restore's pages are checked against on the device, and the checks' launches.

A restore's slot carries, behind its copy table, each page's offset in the device buffer and
what the page is checked against: its stored xxh3-64 (the accident check), or, for a snapshot
opened with keys and signed with BLAKE3 page digests, its signed digest. :class:`PageChecks`
holds those views of the uploaded table and launches the check of a piece of the slot (digest
and compare in one launch: :mod:`kvsnap.transfer.page_hash` or :mod:`kvsnap.transfer.
page_blake3`), whose verdicts the scatter then follows (docs/architecture.md, "Signed means
every KV byte").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsnap.transfer import page_blake3, page_hash


@dataclass(frozen=True)
class PageChecks:
    """What a restore's pages are checked against on the device, as the slot's table carries
    it: ``words`` (each page's offset in the buffer, in 8-byte words), ``stored`` (its stored
    xxh3-64 as int64, or its signed BLAKE3 digest as int32 ``(pages, 8)``: ``blake3``), and
    ``page_ok``, the verdicts (1 written, 0 refused) the checks write."""

    words: torch.Tensor
    stored: torch.Tensor
    page_ok: torch.Tensor
    blake3: bool

    def launch(
        self, buffer: torch.Tensor, page_bytes: int, constants: torch.Tensor | None, pages: slice
    ) -> None:
        """Enqueue the checks of the slot's pages ``pages`` (digest and compare, one launch)."""
        if self.blake3:
            page_blake3.launch_page_blake3_checks_at_words(
                buffer, self.words[pages], page_bytes, self.stored[pages], self.page_ok[pages]
            )
            return
        assert constants is not None
        page_hash.launch_page_checks_at_words(
            buffer,
            self.words[pages],
            page_bytes,
            constants,
            self.stored[pages],
            self.page_ok[pages],
        )


_CONSTANTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def hash_constants(device: torch.device, page_bytes: int) -> torch.Tensor:
    """The digest kernel's constants for ``page_bytes`` on ``device``, uploaded once: a mover
    is made per ``Snapshot.restore`` call, and an upload from pageable memory waits for
    everything the caller's stream holds (a forward pass, say). Never written: kernels on any
    stream may read it."""
    key = (device, page_bytes)
    constants = _CONSTANTS.get(key)
    if constants is None:
        constants = torch.from_numpy(page_hash.constant_table(page_bytes)).to(device)
        _CONSTANTS[key] = constants
    return constants
