"""The ``auto`` policy: which backend a job goes to, from measured thresholds.

``choose_backend`` picks a backend per job from the transfer direction, the job's mean merged
descriptor size and what the machine has. Its thresholds come from the H200 measurements in
docs/benchmarks.md and can be overridden by a calibration file that ``kvsnap bench
--write-calibration`` (or ``python -m benchmarks.transfer --write-calibration``) writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvsnap.caches import register_cache_clear
from kvsnap.transfer.backends import available_backends
from kvsnap.transfer.plan import Direction

# --------------------------------------------------------------------------------------------
# The auto policy's constants. Their figures are the vLLM split NHD rows (GPU→host / host→GPU)
# of the H200 transfer matrix of 2026-11-30: docs/benchmarks.md, "Transfer backends
# (`transfer.py`)", has the whole table, the rule `--write-calibration` derives these values by,
# and (under "Restores and captures on the GPU") the command that measured it.

#: Mean fragment size from which ``auto`` uses the driver's batch copy: there it moves as much
#: as the ``torch`` gather (2 MiB pages: 0.90 / 0.91 of the contiguous copy against 0.90 / 0.92)
#: and leaves the SMs to the model. Below it each descriptor's ~0.5 us of driver time loses to
#: the gather (128 KiB pages: 0.70 / 0.75 against 0.93 / 0.91; 16 KiB: 0.30 / 0.11 against
#: 0.89 / 0.90). ``kvsnap bench --write-calibration`` re-derives it for a machine.
LARGE_FRAGMENT_BYTES: dict[Direction, int] = {
    Direction.DEVICE_TO_HOST: 2 << 20,
    Direction.HOST_TO_DEVICE: 2 << 20,
}
#: Backend ``auto`` uses below the threshold. ``torch`` gathers whole canonical pages on the
#: device (at memory speed) and moves them with contiguous copies, so its host work grows with
#: blocks, not fragments (0.84-0.93 of the contiguous copy on large jobs of 2 KiB-128 KiB
#: pages): the descriptor backends spend more host time planning 2-16 KiB pages (40-50 ns per
#: descriptor) than PCIe spends moving them (38 ns for 2 KiB). ``triton`` is used instead where
#: ``torch`` would write partial host pages (a TP rank's heads at capture), and when ``torch``
#: is unavailable.
SMALL_FRAGMENT_BACKEND = "torch"
SMALL_FRAGMENT_FALLBACK = "triton"
LARGE_FRAGMENT_BACKEND = "cuda-batch"
#: Environment variable naming a calibration JSON; default path below.
CALIBRATION_ENV = "KVSNAP_CALIBRATION"
DEFAULT_CALIBRATION_PATH = Path.home() / ".cache" / "kvsnap" / "calibration.json"
CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class AutoPolicy:
    """Thresholds of the ``auto`` selection: measured defaults, overridable by a calibration file.

    A job goes to :attr:`large_backend` when its mean fragment (unmerged descriptor) is at least
    ``large_fragment_bytes[direction]``, else to :attr:`small_backend`, or to
    :attr:`small_fallback` when that one is unavailable or is ``torch`` facing partial host
    pages at capture. Without CUDA every job goes to ``cpu``.
    """

    large_fragment_bytes: Mapping[Direction, int] = field(
        default_factory=lambda: dict(LARGE_FRAGMENT_BYTES)
    )
    large_backend: str = LARGE_FRAGMENT_BACKEND
    small_backend: str = SMALL_FRAGMENT_BACKEND
    small_fallback: str = SMALL_FRAGMENT_FALLBACK
    source: str = "built-in defaults"

    def choose(
        self,
        device: torch.device,
        direction: Direction,
        mean_fragment_bytes: float,
        whole_pages: bool = True,
        available: Collection[str] | None = None,
    ) -> str:
        """The backend name for one job (see the class docstring).

        ``whole_pages``: every copy of the job covers whole canonical pages (false for a TP
        rank's head slice). ``available`` names the usable backends (default:
        :func:`available_backends`).
        """
        if device.type != "cuda":
            return "cpu"
        available = set(available_backends(device) if available is None else available)
        if (
            mean_fragment_bytes >= self.large_fragment_bytes[direction]
            and self.large_backend in available
        ):
            return self.large_backend
        partial_capture = direction is Direction.DEVICE_TO_HOST and not whole_pages
        if self.small_backend in available and not (
            partial_capture and self.small_backend == "torch" and self.small_fallback in available
        ):
            return self.small_backend
        if self.small_fallback in available:
            return self.small_fallback
        return self.large_backend if self.large_backend in available else "torch"


def calibration_path() -> Path:
    """The calibration file: ``$KVSNAP_CALIBRATION``, else ``~/.cache/kvsnap/calibration.json``."""
    configured = os.environ.get(CALIBRATION_ENV)
    return Path(configured).expanduser() if configured else DEFAULT_CALIBRATION_PATH


def load_policy(path: Path | None = None) -> AutoPolicy:
    """The ``auto`` policy: defaults, overridden by the calibration JSON when one exists.

    The file (written by ``kvsnap bench --write-calibration``, see :mod:`kvsnap.bench`) holds::

        {"version": 1,
         "large_fragment_bytes": {"device_to_host": 65536, "host_to_device": 65536},
         "small_backend": "triton"}

    Every key but ``version`` is optional. A file that is missing is ignored; one that is
    unreadable or malformed raises ``ValueError`` naming the file, so a typo is never silent.
    """
    path = calibration_path() if path is None else path
    if not path.is_file():
        return AutoPolicy()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read kvsnap calibration {path}: {exc}") from exc
    return policy_from_calibration(data, source=str(path))


def policy_from_calibration(data: Mapping[str, Any], source: str = "calibration") -> AutoPolicy:
    """Build an :class:`AutoPolicy` from a parsed calibration mapping (see :func:`load_policy`)."""
    if not isinstance(data, Mapping) or data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"{source}: expected a JSON object with version {CALIBRATION_VERSION}")
    thresholds = dict(LARGE_FRAGMENT_BYTES)
    for key, value in dict(data.get("large_fragment_bytes", {})).items():
        try:
            direction = Direction(key)
        except ValueError:
            raise ValueError(
                f"{source}: unknown direction {key!r} in large_fragment_bytes"
            ) from None
        if not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{source}: large_fragment_bytes[{key!r}] must be a non-negative integer"
            )
        thresholds[direction] = value
    small = data.get("small_backend", SMALL_FRAGMENT_BACKEND)
    if small not in ("triton", "torch", "cuda-batch"):
        raise ValueError(
            f"{source}: small_backend must be triton, torch or cuda-batch, not {small!r}"
        )
    return AutoPolicy(large_fragment_bytes=thresholds, small_backend=small, source=source)


def forget_policy() -> None:
    """Drop the policy :func:`current_policy` cached, so the next job reads the calibration again.

    :func:`kvsnap.bench.calibration.write_calibration` calls it after publishing a new file.
    """
    _cached_policy.cache_clear()


register_cache_clear(forget_policy)


@lru_cache(maxsize=1)
def _cached_policy(path: str) -> AutoPolicy:
    return load_policy(Path(path))


def current_policy() -> AutoPolicy:
    """:func:`load_policy` for the current calibration path, read once per path per process."""
    return _cached_policy(str(calibration_path()))


def choose_backend(
    device: torch.device,
    direction: Direction,
    mean_fragment_bytes: float,
    whole_pages: bool = True,
    available: Collection[str] | None = None,
) -> str:
    """The backend ``auto`` uses for one job, under :func:`current_policy`; ``available`` as
    for :meth:`AutoPolicy.choose` (a handler passes what it probed once)."""
    return current_policy().choose(device, direction, mean_fragment_bytes, whole_pages, available)
