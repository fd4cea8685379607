"""A snapshot format version no kvsnap reads, for the tests of how a file newer than this kvsnap
is refused: one above every version it knows (ordinary 1, parted 2, encoded 3), so that no
reader takes it for a format of its own."""

from __future__ import annotations

from kvsnap.format.constants import SUPPORTED_VERSIONS
from kvsnap.format.encoded import ENCODED_FORMAT_VERSION

#: Above every format version kvsnap knows.
UNKNOWN_FORMAT_VERSION = max(*SUPPORTED_VERSIONS, ENCODED_FORMAT_VERSION) + 1
