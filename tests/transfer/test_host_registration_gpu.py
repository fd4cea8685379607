"""A registration the driver refuses leaves nothing behind (skipped without CUDA): the caller
gets the error code and falls back, and the CUDA runtime's per-thread last error is cleared,
so the next torch call, which checks that error, does not raise it as its own."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kvsnap.host_registration import register_host_range, unregister_host_range

pytestmark = pytest.mark.gpu


def _kernel_runs() -> bool:
    values = torch.arange(4, device="cuda") + 1  # a launch: torch checks the last error here
    torch.cuda.synchronize()
    return values.tolist() == [1, 2, 3, 4]


def test_a_refused_registration_is_reported_and_the_next_kernel_runs(tmp_path: Path) -> None:
    """The case met: a file's mapping registered past the file's end (a spare cut to a
    smaller capture), whose pages do not exist for the driver to pin."""
    with open(tmp_path / "cut", "w+b") as file:
        file.truncate(2 * mmap.PAGESIZE)
        with mmap.mmap(file.fileno(), 2 * mmap.PAGESIZE) as memory:
            file.truncate(mmap.PAGESIZE)
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            assert register_host_range(address, 2 * mmap.PAGESIZE, 0) != 0
            assert _kernel_runs()


def test_unregistering_what_is_not_registered_is_reported_and_the_next_kernel_runs() -> None:
    with mmap.mmap(-1, mmap.PAGESIZE) as memory:
        address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
        assert unregister_host_range(address) != 0
        assert _kernel_runs()


def test_a_registration_and_its_release_succeed() -> None:
    with mmap.mmap(-1, 4 * mmap.PAGESIZE) as memory:
        host = torch.frombuffer(memory, dtype=torch.uint8)
        host[:] = 7
        assert register_host_range(host.data_ptr(), host.numel(), 0) == 0
        device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert int(device.sum()) == 7 * host.numel()
        assert unregister_host_range(host.data_ptr()) == 0
        del host  # the mapping closes only once no tensor views it
