"""Waits that Ctrl-C does not cut short: an abort must finish waiting for the writes it
cancels before it removes their files."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ABSORBED_INTERRUPTS", "uninterrupted"]


#: ``KeyboardInterrupt``s an abort's wait absorbs before it lets the next one through.
ABSORBED_INTERRUPTS = 2


def uninterrupted(work: Callable[[], None]) -> KeyboardInterrupt | None:
    """Run ``work`` to its end even when ``KeyboardInterrupt`` arrives meanwhile (``work`` is
    then run again: it must be a wait that may be repeated); returns the last interrupt. After
    :data:`ABSORBED_INTERRUPTS` of them the next one propagates: a wait that cannot end must
    not make Ctrl-C powerless."""
    interrupted: KeyboardInterrupt | None = None
    for _ in range(ABSORBED_INTERRUPTS):
        try:
            work()
            return interrupted
        except KeyboardInterrupt as error:
            interrupted = error
    work()
    return interrupted
