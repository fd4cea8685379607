"""Child process of the Ctrl-C tests: runs the CLI or a library capture on slow storage.

``python tests/support/interrupt_child.py MODE MARKER DELAY SLOWED [ARGS...]``

``SLOWED`` names what is slow: ``write`` (every layer-data write of the snapshot writer takes
``DELAY`` seconds more, as on slow or remote storage) or ``synthesize`` (the synthetic KV takes
``DELAY`` seconds to build, a phase before any file exists). The first slow call creates the
file ``MARKER``: the parent sends SIGINT once it appears, so the signal lands mid-phase every
time, not by luck. ``write+exit`` also makes the process's exit take ``DELAY`` seconds (an
``atexit`` hook, as a flush to slow storage would) and creates ``MARKER.exit`` as it starts.

``MODE`` ``cli`` runs ``kvsnap ARGS...`` in this process. ``MODE`` ``library`` captures a
synthetic cache to the path ``ARGS[0]`` with :func:`kvsnap.capture`; on ``KeyboardInterrupt``
it prints one JSON line, ``{"interrupted": true, "temps": [...]}`` (the temporary files in the
target directory at the moment the interrupt reached the caller), and exits 0.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsnap.store.write import local_target as write_local
from kvsnap.testing import synthetic


def _slowed(function: Callable[..., Any], marker: Path, delay: float) -> Callable[..., Any]:
    """``function``, taking ``delay`` seconds more per call; the first call creates ``marker``."""

    def slow(*args: Any, **kwargs: Any) -> Any:
        marker.touch(exist_ok=True)
        time.sleep(delay)
        return function(*args, **kwargs)

    return slow


def _library_capture(path: str) -> None:
    import kvsnap

    spec = synthetic.make_spec(
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype="bfloat16",
        sequence_lengths=[8000],
        seed=1,
    )
    cache = synthetic.build_cache(spec)
    try:
        kvsnap.capture(cache.layout, cache.sequences, path, source=synthetic.source_info(spec))
    except KeyboardInterrupt:
        directory = os.path.dirname(os.path.abspath(path))
        temps = sorted(name for name in os.listdir(directory) if ".kvsnap-tmp-" in name)
        print(json.dumps({"interrupted": True, "temps": temps}), flush=True)


def main() -> None:
    mode, marker, delay, slowed, *arguments = sys.argv[1:]
    marker_path, seconds = Path(marker), float(delay)
    if slowed == "write+exit":
        exiting = marker_path.with_suffix(".exit")
        atexit.register(_slowed(lambda: None, exiting, seconds))
    if slowed.startswith("write"):
        target = write_local.LocalTarget
        target.write_data = _slowed(target.write_data, marker_path, seconds)  # type: ignore[method-assign]
    else:
        synthetic.build_cache = _slowed(synthetic.build_cache, marker_path, seconds)
    if mode == "library":
        _library_capture(arguments[0])
        return
    from kvsnap.cli.app import main as cli_main

    sys.argv = ["kvsnap", *arguments]
    cli_main()


if __name__ == "__main__":
    main()
