"""Who signed a snapshot and how its signature binds it: the methods of
:class:`~kvsnap.snapshot.Snapshot` that read or check signatures (:class:`SnapshotSignatures`,
which ``Snapshot`` inherits), asked of whichever it opened: an ordinary snapshot's files, or an
encoded snapshot's encoded file, whose own signature covers its decoded file (unsigned by
design)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap import format as fmt
from kvsnap.format.encoded import PAGES_SIGNATURE_ALGORITHM
from kvsnap.format.encoded import SIGNATURE_ALGORITHM as ENCODED_SIGNATURE_ALGORITHM

if TYPE_CHECKING:
    from kvsnap.encoded.opening import EncodedSnapshot
    from kvsnap.errors import SignatureError
    from kvsnap.format.signing import KeyRing
    from kvsnap.store.read.head_parts import OpenedSnapshot

__all__ = ["SnapshotSignatures"]


class SnapshotSignatures:
    """What :class:`~kvsnap.snapshot.Snapshot` says of its signature: ``_opened`` is the
    snapshot's own (an ordinary snapshot's parts, or an encoded snapshot)."""

    _opened: OpenedSnapshot | EncodedSnapshot

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for each file of the snapshot, if they do not.

        Args:
            keys: The keys a file must be signed by (``kvsnap.store.files.keys.load_key_ring``).

        Returns:
            One ``UnsignedSnapshotError`` or ``BadSignatureError`` per file that fails (of an
            encoded snapshot: the encoded file); an empty list when every file is signed by
            one of the keys over exactly the bytes its signature covers (its pages are
            checked by ``verify`` of a snapshot opened with the keys).

        Example:
            >>> import kvsnap
            >>> from kvsnap.format import KeyRing
            >>> keys = KeyRing([bytes(range(32))])
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     [type(problem).__name__ for problem in snap.signature_problems(keys)]
            ['UnsignedSnapshotError']
        """
        return self._opened.signature_problems(keys)

    @property
    def signature_algorithm(self) -> str | None:
        """The algorithm of the signature that vouches for the snapshot, as written (unchecked).

        An ordinary snapshot's, from its metadata: ``"hmac-sha256-blake3"`` (each page bound
        by its signed BLAKE3 digest) or ``"hmac-sha256"`` (older: pages bound by xxh3-64
        only). An encoded snapshot's is its encoded file's own (its decoded file is unsigned
        by design): ``"encoded-hmac-sha256-blake3"`` (every stored tensor bound by its
        BLAKE3) or ``"encoded-hmac-sha256-blake3-pages"`` (each fp8 page bound by its signed
        BLAKE3 digest, every other tensor by its BLAKE3). ``None``: unsigned.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.signature_algorithm is None  # captured without keys
            True
        """
        return self._opened.signature_algorithm

    def signing_key_ids(self) -> list[str | None]:
        """Per file, the hex id of the key that signed it, as written (not checked).

        Returns:
            One entry per file (an encoded snapshot: its encoded file): the signing key's hex
            id, or ``None`` for an unsigned file.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.signing_key_ids()
            [None]
        """
        return self._opened.signing_key_ids()

    @property
    def page_binding(self) -> str | None:
        """How a signed snapshot's signature binds its pages (unchecked: only a snapshot
        opened with ``keys`` had its signature checked), by ``signature_algorithm``.

        ``"blake3"``: through BLAKE3, which the signature covers (what kvsnap writes: an
        ordinary file's page digests, an encoded file's stored tensors or fp8 page digests);
        opened with ``keys``, every page read, verified or restored is checked against it.
        ``"xxh3-64"``: an older signed snapshot, its pages bound by xxh3-64 checksums only,
        which are not collision-resistant. ``None``: unsigned.

        Example:
            >>> import kvsnap
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     snap.page_binding is None  # captured without keys
            True
        """
        algorithm = self.signature_algorithm
        return None if algorithm is None else _PAGE_BINDINGS.get(algorithm)


#: :attr:`Snapshot.page_binding` by :attr:`Snapshot.signature_algorithm`.
_PAGE_BINDINGS = {
    fmt.SIGNATURE_ALGORITHM: "blake3",
    fmt.SIGNATURE_ALGORITHM_V1: "xxh3-64",
    ENCODED_SIGNATURE_ALGORITHM: "blake3",
    PAGES_SIGNATURE_ALGORITHM: "blake3",
}
