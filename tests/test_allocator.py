"""allocator.py: the heap is used in training passes and the mmap cap comes back after, even on error."""
import pytest

from ppo_affine import allocator


def test_training_allocations_reuse_the_heap_and_restore_the_cap_even_on_error(monkeypatch):
    calls = []

    class FakeLibc:
        def mallopt(self, option, value):
            calls.append(("mallopt", option, value))

        def malloc_trim(self, pad):
            calls.append(("malloc_trim", pad))

    monkeypatch.setattr(allocator, "_libc", lambda: FakeLibc())
    with pytest.raises(RuntimeError):
        with allocator.training_allocations():
            assert calls == [("mallopt", -3, 16 * 1024 * 1024)]
            raise RuntimeError("a failed update")
    assert calls[1:] == [("mallopt", -3, 256 * 1024), ("malloc_trim", 0)]

    monkeypatch.setattr(allocator, "_libc", lambda: None)  # not glibc: nothing to tune, the block still runs
    with allocator.training_allocations():
        ran = True
    assert ran
