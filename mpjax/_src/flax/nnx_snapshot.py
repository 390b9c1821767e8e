"""The variables of an NNX module subtree, to undo a call that failed part-way."""

from __future__ import annotations

from flax import nnx

__all__ = ["NnxSnapshot"]


class NnxSnapshot:
    """Every `nnx.Variable` value and variable attribute under a module, to put back.

    Values are shared, not copied. `restore` sets each variable's value back (RNG
    counts, batch statistics, caches, parameters) and removes variable attributes the
    call added (e.g. by `sow`).
    """

    def __init__(self, root: nnx.Module):
        self.values = []
        self.attrs = []
        for _, node in nnx.iter_graph(root):
            if isinstance(node, nnx.Variable):
                self.values.append((node, node.get_raw_value()))
            elif isinstance(node, nnx.Module):
                self.attrs.append((node, set(vars(node))))
        self.root = root

    def restore(self) -> None:
        """Puts the snapshot's values back and drops variable attributes added since."""
        for module, names in self.attrs:
            for name in [n for n in vars(module) if n not in names]:
                if isinstance(vars(module)[name], nnx.Variable):
                    delattr(module, name)
        for var, raw in self.values:
            # The raw write skips NNX's trace-level check: it undoes this call's writes.
            object.__setattr__(var, "_raw_value", raw)
