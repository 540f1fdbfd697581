"""Torch's own count of tensor bytes alive at once on any device, the CPU included (where torch keeps no such
count): what a CUDA allocator's max_memory_allocated reports, for tests and bench/ to compare memory on the CPU."""
from __future__ import annotations


class LiveBytes:
    """The most bytes of tensor storage alive at once while it is entered (what a CUDA allocator's
    max_memory_allocated counts), tracked through every operation's outputs, the backward pass's included. An output
    that shares an input's storage (a view such as the transposed weight a linear layer multiplies by, an in-place
    result) allocates nothing and is not counted: counted, every weight a pass used would be counted again as
    new memory, and stay counted, as the weights are never freed."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((args, kwargs))
                          if isinstance(leaf, torch.Tensor)}
                tracker.track(tree_leaves(out), aliases=inputs)
                return out

        self.mode, self.live, self.peak, self.seen = Mode(), 0, 0, set()

    def track(self, out, aliases: set[int] = frozenset()) -> None:
        """Count the storages of `out` (a tensor or a list of them) that are new: none of `aliases` (the op's inputs'
        storages) and not counted already."""
        import weakref

        import torch

        for tensor in (out if isinstance(out, (list, tuple)) else [out]):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or key in aliases or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())

    def _freed(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size
