"""The order a snapshot writer takes layer pages in, and how far they got.

A writer's caller hands over every layer tensor in file order (:meth:`WriteOrder.due` names
the one expected), each tensor's blocks in order, possibly over several calls:
:meth:`WriteOrder.checked` refuses a page of any other tensor, or more blocks than a tensor
has; :meth:`WriteOrder.count` moves the order on; :meth:`WriteOrder.missing` names the tensors
a commit would find incomplete. Bookkeeping only: nothing here touches a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class WriteOrder:
    """Per layer tensor of a snapshot (``names``, in file order, ``tensor_index`` their
    positions), the blocks handed over of ``num_blocks`` each, and the tensor due next."""

    def __init__(
        self, names: Sequence[str], tensor_index: Mapping[str, int], num_blocks: int
    ) -> None:
        self.names = list(names)
        self.num_blocks = num_blocks
        self._tensor_index = tensor_index
        #: Per tensor, the blocks handed over so far.
        self.blocks_written = [0] * len(self.names)
        #: The tensor due next; ``len(names)`` once every tensor is complete.
        self.current = 0 if num_blocks else len(self.names)

    @property
    def started(self) -> bool:
        """Whether any page was handed over."""
        return any(self.blocks_written)

    def due(self) -> str | None:
        """The name of the tensor due next (``None``: every tensor is complete)."""
        return self.names[self.current] if self.current < len(self.names) else None

    def checked(self, name: str, count: int) -> int:
        """The index of tensor ``name``, checked (``ValueError``) to be a layer tensor, the one
        due, and to have room for ``count`` more blocks."""
        if name not in self._tensor_index:
            raise ValueError(
                f"{name!r} is not a layer tensor of this snapshot (see tensor_order())"
            )
        tensor = self._tensor_index[name]
        if tensor != self.current:
            expected = self.due() or "nothing (commit)"
            raise ValueError(
                f"write_pages got {name}, expected {expected}: tensors go in tensor_order()"
            )
        first = self.blocks_written[tensor]
        if first + count > self.num_blocks:
            raise ValueError(
                f"{name}: {first} blocks written, {count} more exceed the {self.num_blocks} blocks"
            )
        return tensor

    def count(self, tensor: int, count: int) -> bool:
        """``count`` more blocks of ``tensor`` are handed over; whether that completed it (the
        order then moves on to the next tensor)."""
        self.blocks_written[tensor] += count
        if self.blocks_written[tensor] != self.num_blocks:
            return False
        self.current += 1
        return True

    def missing(self) -> list[str]:
        """Each incomplete tensor as ``"name (written/total blocks)"``, in file order."""
        return [
            f"{name} ({written}/{self.num_blocks} blocks)"
            for name, written in zip(self.names, self.blocks_written, strict=True)
            if written != self.num_blocks
        ]
