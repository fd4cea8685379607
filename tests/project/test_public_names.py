"""No public name disappears: every ``module:name`` recorded in ``public_names.txt`` (the public
names of ``kvsnap``, ``kvsnap.store``, each module that was under ``kvsnap/store/`` and each
module the docs name, listed by ``python -m tests.support.public_names``) still imports from
its module, through the deprecation alias where the module moved."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

RECORDED = Path(__file__).with_name("public_names.txt")


def test_every_recorded_public_name_still_imports_from_its_module() -> None:
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for line in RECORDED.read_text().split():
            module, name = line.split(":")
            try:
                loaded = importlib.import_module(module)
            except ImportError as error:
                missing.append(f"{line} (module: {error})")
                continue
            if not hasattr(loaded, name):
                missing.append(line)
    assert not missing, "public names that disappeared:\n" + "\n".join(missing)
