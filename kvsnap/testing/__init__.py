"""Testing helpers: golden KV snapshot assertions (pytest plugin) and synthetic KV fixtures.

``assert_kv_matches`` is importable without torch (it imports the comparison machinery on first
use); the synthetic generator's names (``generate``, ``synthesize``, ``build_cache``,
``SyntheticSpec``, ...) are imported on first access, since they need torch. The plugin's names
are imported on first access too, since the plugin needs pytest: ``kvsnap fixture`` uses
:mod:`kvsnap.testing.synthetic` in installs without the test extras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see of the names below, imported on first use
    from kvsnap.testing.plugin import (
        GOLDEN_DIRNAME,
        KVSnapshotChecker,
        assert_kv_matches,
        golden_path,
    )
    from kvsnap.testing.synthetic import (
        GENERATOR_VERSION,
        SyntheticCache,
        SyntheticSequence,
        SyntheticSpec,
        apply_rope,
        build_cache,
        generate,
        make_spec,
        synthesize,
    )

_PLUGIN = ("GOLDEN_DIRNAME", "KVSnapshotChecker", "assert_kv_matches", "golden_path")
_SYNTHETIC = (
    "GENERATOR_VERSION",
    "SyntheticCache",
    "SyntheticSequence",
    "SyntheticSpec",
    "apply_rope",
    "build_cache",
    "generate",
    "make_spec",
    "synthesize",
)

#: Spelled out, since type checkers read a literal list only.
__all__ = [
    "GENERATOR_VERSION",
    "GOLDEN_DIRNAME",
    "KVSnapshotChecker",
    "SyntheticCache",
    "SyntheticSequence",
    "SyntheticSpec",
    "apply_rope",
    "assert_kv_matches",
    "build_cache",
    "generate",
    "golden_path",
    "make_spec",
    "synthesize",
]


def __getattr__(name: str) -> Any:
    if name in _PLUGIN:
        return getattr(importlib.import_module("kvsnap.testing.plugin"), name)
    if name in _SYNTHETIC:
        return getattr(importlib.import_module("kvsnap.testing.synthetic"), name)
    raise AttributeError(f"module 'kvsnap.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
