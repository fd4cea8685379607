"""Reusable page-locked host memory: one pool allocated once, handed out as staging-ring slots.

Pinning is slow (seconds for a few GiB on an H200 host) and torch's pinned allocator rounds
every request up to a power of two, so kvsnap allocates one buffer, registers it with the
driver in chunks of whole slots (at most 1 GiB, unless one slot is larger), reuses it for every
job and unregisters it before freeing. A ``lazy`` pool registers each slot on its first use
instead, so a capture's first transfer waits for one slot's pinning, not the whole pool's.
On machines without CUDA the same pool is plain host memory, so the CPU path and the tests run
the code that the GPU path runs.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvsnap.host_registration import register_host_range, unregister_host_range

#: Largest span handed to one ``cudaHostRegister`` call; larger registrations stall the driver.
#: Chunks are cut at slot boundaries, so a slot larger than this is registered on its own.
MAX_REGISTER_CHUNK_BYTES = 1 << 30
#: Alignment of every slot: O_DIRECT needs 4096, and it keeps DMA descriptors page-aligned.
SLOT_ALIGNMENT_BYTES = 4096


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Slot:
    """One slot of a :class:`PinnedPool`: ``size_bytes`` of host memory at ``data_ptr``."""

    index: int
    data_ptr: int
    size_bytes: int
    tensor: torch.Tensor  # uint8 view of the slot; keeps nothing alive beyond the pool

    def as_numpy(self, num_bytes: int | None = None) -> np.ndarray:
        """A uint8 numpy view of the first ``num_bytes`` (default: all) bytes of the slot."""
        view = self.tensor.numpy()
        return view if num_bytes is None else view[:num_bytes]


class PinnedPool:
    """A fixed set of equally sized, 4096-aligned host slots backed by one allocation.

    Args:
        slot_bytes: size of each slot, rounded up to 4096.
        num_slots: how many slots; ``acquire`` blocks while all of them are in use.
        pin: register the memory with CUDA. ``None`` pins exactly when CUDA is available.
        lazy: register each slot when it is first acquired (or asked for with :meth:`slot`)
            rather than the whole pool up front; freed slots are reused first, so slots a
            job never needs at once are never pinned.

    The pool is a context manager; :meth:`close` unregisters (when pinned) and frees.
    """

    def __init__(
        self, slot_bytes: int, num_slots: int, pin: bool | None = None, *, lazy: bool = False
    ) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"PinnedPool needs positive sizes, got {slot_bytes=} {num_slots=}")
        self.slot_bytes = _align_up(slot_bytes, SLOT_ALIGNMENT_BYTES)
        self.num_slots = num_slots
        self.total_bytes = self.slot_bytes * num_slots
        # Over-allocate by one alignment unit and start at the first aligned byte.
        self._backing = torch.empty(self.total_bytes + SLOT_ALIGNMENT_BYTES, dtype=torch.uint8)
        base = self._backing.data_ptr()
        start = _align_up(base, SLOT_ALIGNMENT_BYTES) - base
        self._memory = self._backing[start : start + self.total_bytes]
        self.data_ptr = self._memory.data_ptr()
        self.pinned = False
        self._registered: list[int] = []
        self._slot_pinned = [False] * num_slots
        self._register_lock = threading.Lock()
        if pin is None:
            pin = torch.cuda.is_available()
        self._pin_on_use = bool(pin) and lazy
        if pin and not lazy:
            self._register()
        self._free = list(range(num_slots - 1, -1, -1))
        self._cond = threading.Condition()
        self._closed = False

    def _register(self) -> None:
        # Touch every page first so registration does not fault them in one by one.
        self._memory.zero_()
        # Chunks hold whole slots: a DMA copy may not span two registrations (the driver
        # rejects it), and descriptors never leave their slot.
        step = max(self.slot_bytes, MAX_REGISTER_CHUNK_BYTES // self.slot_bytes * self.slot_bytes)
        for offset in range(0, self.total_bytes, step):
            size = min(step, self.total_bytes - offset)
            code = register_host_range(self.data_ptr + offset, size, 0)
            if code != 0:
                self._unregister()
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
            self._registered.append(self.data_ptr + offset)
        self._slot_pinned = [True] * self.num_slots
        self.pinned = True

    def _pin_slot(self, index: int) -> None:
        """Register slot ``index`` on its own, once (lazy pools)."""
        with self._register_lock:
            if self._slot_pinned[index]:
                return
            start = index * self.slot_bytes
            memory = self._memory[start : start + self.slot_bytes]
            memory.zero_()  # fault the pages in before the driver locks them
            code = register_host_range(memory.data_ptr(), self.slot_bytes, 0)
            if code != 0:
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
            self._registered.append(memory.data_ptr())
            self._slot_pinned[index] = True
            self.pinned = True

    def _unregister(self) -> None:
        if not self._registered:
            return
        for address in self._registered:
            unregister_host_range(address)
        self._registered.clear()
        self._slot_pinned = [False] * self.num_slots
        self.pinned = False

    def slot(self, index: int) -> Slot:
        """The slot at ``index`` (no ownership implied; see :meth:`acquire`); a lazy pool
        registers it first."""
        if self._pin_on_use and not self._slot_pinned[index]:
            self._pin_slot(index)
        start = index * self.slot_bytes
        return Slot(
            index=index,
            data_ptr=self.data_ptr + start,
            size_bytes=self.slot_bytes,
            tensor=self._memory[start : start + self.slot_bytes],
        )

    def acquire(self, timeout: float | None = None, *, oldest: bool = False) -> Slot:
        """Take a free slot, waiting up to ``timeout`` seconds (forever when ``None``): the one
        given back last (its memory is the likeliest to be pinned and cached already), or with
        ``oldest`` the one given back first."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, timeout):
                raise TimeoutError(f"no staging slot freed within {timeout} s")
            if self._closed:
                raise RuntimeError("PinnedPool is closed")
            index = self._free.pop(0 if oldest else -1)
        return self._slot_or_release(index)

    def try_acquire_where(self, accept: Callable[[int], bool]) -> Slot | None:
        """Take, without waiting, the free slot given back last among those whose index
        ``accept`` takes (``None`` if there is none)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("PinnedPool is closed")
            for position in range(len(self._free) - 1, -1, -1):
                if accept(self._free[position]):
                    index = self._free.pop(position)
                    break
            else:
                return None
        return self._slot_or_release(index)

    def _slot_or_release(self, index: int) -> Slot:
        # Outside the lock: a first-use registration must not hold up release() elsewhere.
        try:
            return self.slot(index)
        except BaseException:
            self._release_index(index)
            raise

    def try_acquire(self) -> Slot | None:
        """Take a free slot if there is one, without waiting."""
        try:
            return self.acquire(timeout=0)
        except TimeoutError:
            return None

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back to the pool."""
        self._release_index(slot.index)

    def _release_index(self, index: int) -> None:
        """Give the slot at ``index`` back to the pool."""
        with self._cond:
            if index in self._free:
                raise ValueError(f"slot {index} released twice")
            self._free.append(index)
            self._cond.notify()

    @contextmanager
    def borrowed(self, timeout: float | None = None) -> Iterator[Slot]:
        """``with pool.borrowed() as slot:`` acquires a slot and always releases it."""
        slot = self.acquire(timeout)
        try:
            yield slot
        finally:
            self.release(slot)

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        """Unregister and drop the memory; waiting ``acquire`` calls fail."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._unregister()
        del self._memory, self._backing

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unregistering is required before the memory goes back to the allocator.
        if not getattr(self, "_closed", True):
            self.close()


def host_address_view(address: int, num_bytes: int) -> np.ndarray:
    """A uint8 numpy view of ``num_bytes`` of host memory at ``address`` (no copy, no ownership)."""
    if num_bytes == 0:
        return np.empty(0, dtype=np.uint8)
    buffer = (ctypes.c_uint8 * num_bytes).from_address(address)
    return np.frombuffer(buffer, dtype=np.uint8)
