"""Token sequences that begin alike, and how to group them so that each common prefix is run once.

Episodes of one game share its rules; a group's episodes of one task and seed share their whole
first prompt. Scoring, the update and generation run such a prefix once for all the rows of a
micro-batch (or wave) that hold it. `partition` decides which rows go together: sequences in token
order, cut into consecutive groups so that the total cost is smallest.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

MIN_SHARED_PREFIX = 16  # a shorter common prefix is not worth a second forward call
CALL_OVERHEAD = 128  # what one more forward call costs, in tokens: rows of similar length still batch together


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def padded_cost(rows: int, shared: int, longest: int) -> int:
    """Tokens through the model for `rows` right-padded rows of width `longest` whose first `shared` tokens
    are the same in every row (run once when that is at least MIN_SHARED_PREFIX)."""
    if rows > 1 and shared >= MIN_SHARED_PREFIX:
        return shared + rows * (longest - shared)
    return rows * longest


def partition(token_ids: Sequence[Sequence[int]], group_cost: Callable[[int, int, int], int | None]
              ) -> list[tuple[list[int], int]]:
    """Indices in token order, cut into consecutive groups of smallest total cost (each group also pays
    CALL_OVERHEAD); returns (indices, shared prefix length) per group. `group_cost(rows, shared, longest)`
    is a group's cost, or None when such a group is not allowed (a group of one always is)."""
    order = sorted(range(len(token_ids)), key=lambda i: token_ids[i])
    # adjacent[k]: tokens order[k] has in common with order[k - 1]
    adjacent = [0] + [common_prefix(token_ids[order[k - 1]], token_ids[order[k]]) for k in range(1, len(order))]
    best = [0] * (len(order) + 1)  # best[j]: smallest cost of the first j sequences
    start = [0] * (len(order) + 1)  # where the last group of that best split starts
    for end in range(1, len(order) + 1):
        shared, longest = len(token_ids[order[end - 1]]), 0
        best[end] = -1
        for first in range(end - 1, -1, -1):
            longest = max(longest, len(token_ids[order[first]]))
            if first < end - 1:
                shared = min(shared, adjacent[first + 1])
            rows = end - first
            cost = longest if rows == 1 else group_cost(rows, shared, longest)
            if cost is None:
                break  # longer groups reaching further back only cost more
            total = best[first] + cost + CALL_OVERHEAD
            if best[end] < 0 or total < best[end]:
                best[end], start[end] = total, first
    groups: list[tuple[list[int], int]] = []
    end = len(order)
    while end > 0:
        first = start[end]
        rows = order[first:end]
        shared = min((adjacent[k] for k in range(first + 1, end)), default=len(token_ids[rows[0]]))
        groups.append((rows, shared))
        end = first
    return groups[::-1]
