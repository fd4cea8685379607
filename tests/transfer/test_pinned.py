"""PinnedPool registration against a recording stand-in for the CUDA runtime.

The stand-in records every ``cudaHostRegister``/``cudaHostUnregister`` call, so the tests check
what is registered, when, and that every registration is undone, without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kvsnap.transfer import pinned
from kvsnap.transfer.pinned import PinnedPool


class RecordingCudart:
    """Registers nothing; records the calls. ``fail_next`` makes the next register fail."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.history: list[tuple[str, int, int]] = []
        self.fail_next = False

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.fail_next:
            self.fail_next = False
            return 2  # cudaErrorMemoryAllocation
        assert address not in self.registered, "registered twice"
        self.registered[address] = size
        self.history.append(("register", address, size))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        size = self.registered.pop(address)
        self.history.append(("unregister", address, size))
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> RecordingCudart:
    runtime = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    return runtime


def test_an_eager_pool_registers_whole_slots_up_front(
    cudart: RecordingCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "MAX_REGISTER_CHUNK_BYTES", 3 * 8192)
    pool = PinnedPool(8192, 7, pin=True)
    slots = [pool.slot(index) for index in range(7)]
    # Chunks of at most three whole slots, covering the pool once, in order.
    assert [(address, size) for _, address, size in cudart.history] == [
        (slots[0].data_ptr, 3 * 8192),
        (slots[3].data_ptr, 3 * 8192),
        (slots[6].data_ptr, 8192),
    ]
    pool.close()
    assert cudart.registered == {}


def test_a_lazy_pool_registers_each_slot_on_first_use_only(cudart: RecordingCudart) -> None:
    pool = PinnedPool(8192, 4, pin=True, lazy=True)
    assert cudart.history == [] and not pool.pinned
    first = pool.acquire()
    assert cudart.registered == {first.data_ptr: 8192} and pool.pinned
    pool.release(first)
    # A freed slot is reused first, so it is not registered again.
    again = pool.acquire()
    assert again.index == first.index and len(cudart.history) == 1
    second = pool.acquire()
    assert cudart.registered == {first.data_ptr: 8192, second.data_ptr: 8192}
    pool.slot(3)  # asking for a slot by index registers it too
    assert len(cudart.registered) == 3
    pool.release(again)
    pool.release(second)
    pool.close()
    assert cudart.registered == {}
    assert sorted(kind for kind, _, _ in cudart.history) == ["register"] * 3 + ["unregister"] * 3


def test_a_failed_registration_returns_the_slot(cudart: RecordingCudart) -> None:
    with PinnedPool(8192, 2, pin=True, lazy=True) as pool:
        cudart.fail_next = True
        with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
            pool.acquire()
        assert pool.num_free == 2 and cudart.registered == {}
        slot = pool.acquire()  # the next attempt registers and succeeds
        assert cudart.registered == {slot.data_ptr: 8192}
        pool.release(slot)


def test_unpinned_pools_never_call_the_runtime(cudart: RecordingCudart) -> None:
    with PinnedPool(8192, 2, pin=False, lazy=True) as pool:
        pool.release(pool.acquire())
    with PinnedPool(8192, 2, pin=False) as pool:
        pool.slot(1)
    assert cudart.history == []


def test_try_acquire_never_waits(cudart: RecordingCudart) -> None:
    with PinnedPool(4096, 2, pin=False) as pool:
        first, second = pool.try_acquire(), pool.try_acquire()
        assert first is not None and second is not None and first.index != second.index
        assert pool.try_acquire() is None
        pool.release(first)
        again = pool.try_acquire()
        assert again is not None and again.index == first.index


def test_slots_are_taken_newest_or_oldest_given_back_first(cudart: RecordingCudart) -> None:
    with PinnedPool(4096, 4, pin=False) as pool:
        slots = [pool.acquire() for _ in range(4)]
        for index in (2, 0, 3, 1):
            pool.release(slots[index])
        assert pool.acquire().index == 1  # the one given back last: likeliest to be warm
        assert pool.acquire(oldest=True).index == 2  # ... or the first, whose copy ends first
        pool.release(slots[1])
        pool.release(slots[2])  # free, newest last: 0, 3, 1, 2


def test_try_acquire_where_takes_the_newest_slot_it_accepts(cudart: RecordingCudart) -> None:
    with PinnedPool(4096, 4, pin=False) as pool:
        slots = [pool.acquire() for _ in range(4)]
        for index in (3, 1, 0):
            pool.release(slots[index])
        taken = pool.try_acquire_where(lambda index: index != 0)
        assert taken is not None and taken.index == 1
        assert pool.try_acquire_where(lambda index: index == 2) is None  # not free
        assert pool.try_acquire_where(lambda index: False) is None
        assert pool.num_free == 2  # nothing taken by the refusals
