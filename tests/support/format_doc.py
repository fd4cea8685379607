"""The decoding recipe of docs/format.md's "Encoded snapshots" section (numpy, zstandard and
xxhash only), executed from the doc itself: an independent decoder for the tests."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def doc_recipe() -> dict:
    """The names the Python block of the doc's "Encoded snapshots" section defines."""
    section = DOC.read_text().split("## Encoded snapshots", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # the doc's own code, nothing of kvsnap's
    return scope
