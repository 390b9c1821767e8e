"""`OrientedBlocks`: the block-quantised copies of a 2-D tensor that its GEMMs read."""

from __future__ import annotations

from mpjax._src.core.dataclass import pytree_dataclass
from mpjax._src.fp8.blocks import BlockQuantized

__all__ = ["OrientedBlocks"]


@pytree_dataclass
class OrientedBlocks:
    """The copies of a 2-D tensor `x` `[M, K]` that its GEMMs read.

    Attributes:
      rows: `x` quantised along `K` (`[M, K]`), or None when not asked for.
      columns: `x^T` quantised along `M` (`[K, M]`), or None when not asked for.
    """

    rows: BlockQuantized | None
    columns: BlockQuantized | None
