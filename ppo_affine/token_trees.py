"""Several token sequences of one episode as one prefix tree, run through the model once.

When the conversation a turn shows is not an extension of the tokens the model wrote before (the
env strips earlier reasoning, or a template re-renders history), each such turn is its own sequence
holding the whole conversation before it: a goofspiel episode with reasons is eight sequences that
repeat one growing history. As a tree, the shared part of those sequences is one trunk of tokens and
each turn's own reply is a branch off it; every token attends to exactly the tokens before it in its
own sequence (its ancestors) at the position it has there, so its log-prob, value and gradient are
those of the separate sequences, and each token is computed once.

A tree is stored flat: tokens in insertion order and, per token, the index of the token before it in
its sequence (`parents`, -1 at the root). A plain sequence is the tree whose parents are i - 1.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppo_affine.prefixes import common_prefix

ROOT = -1


class TreeBuilder:
    """Sequences merged into one tree, one at a time, in their order.

    A sequence shares every leading token it has in common with the tree, up to its first span of trained
    tokens: those are never shared, so each is scored, and trained, exactly once (by its own sequence)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.spans: list[tuple[int, int]] = []  # every added sequence's spans at their flat positions, in order
        self._children: dict[tuple[int, int], int] = {}  # (parent index, token) -> index

    def _shared(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """(the tree node `ids` leaves the tree after, how many leading tokens it shares with it)."""
        first_trained = spans[0][0] if spans else len(ids)
        node, shared = ROOT, 0
        while shared < first_trained and (node, ids[shared]) in self._children:
            node = self._children[(node, ids[shared])]
            shared += 1
        return node, shared

    def added_tokens(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> int:
        """How many tokens adding this sequence would add to the tree."""
        return len(ids) - self._shared(ids, spans)[1]

    def add(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> None:
        node, shared = self._shared(ids, spans)
        offset = len(self.tokens) - shared  # position p >= shared of this sequence sits at p + offset
        for token in ids[shared:]:
            self._children.setdefault((node, token), len(self.tokens))  # a repeated reply: the first one leads on
            self.tokens.append(token)
            self.parents.append(node)
            node = len(self.tokens) - 1
        self.spans.extend((start + offset, end + offset) for start, end in spans)


def unique_token_count(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens of the prefix tree of `sequences` (every shared prefix counted once): what one pass over them
    must compute at least. Sorted, each sequence adds what it does not have in common with the one before."""
    total, previous = 0, []
    for ids in sorted(map(list, sequences)):
        total += len(ids) - common_prefix(previous, ids)
        previous = ids
    return total


def paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The tree's sequences: the tokens from the root to each leaf."""
    inner = set(parents)
    out = []
    for leaf in range(len(tokens)):
        if leaf in inner:
            continue
        path, node = [], leaf
        while node != ROOT:
            path.append(tokens[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def chain_length(parents: Sequence[int]) -> int:
    """How many leading tokens of a tree are one plain chain (each one's parent the token before it)."""
    for index, parent in enumerate(parents):
        if parent != index - 1:
            return index
    return len(parents)


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's position in its own sequence: its number of ancestors."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == ROOT else out[parent] + 1)
    return out


def ancestor_mask(parents: Sequence[int], width: int) -> torch.Tensor:
    """[width, width] bool: row i is True at i and every ancestor of i. Positions past the tree (padding)
    continue a chain from the last token; nothing real attends to them. Built a run of consecutive tokens at
    a time (a run, i.e. a chain, copies its first token's parent row): as many runs as branches."""
    mask = torch.zeros((width, width), dtype=torch.bool)
    full = list(parents) + list(range(len(parents) - 1, width - 1))
    start = 0
    while start < width:
        end = start + 1
        while end < width and full[end] == end - 1:
            end += 1
        if full[start] != ROOT:
            mask[start:end] = mask[full[start]]
        mask[start:end, start:end] |= torch.ones((end - start, end - start), dtype=torch.bool).tril()
        start = end
    return mask


@dataclass
class TreeRows:
    """The layout of a right-padded [B, T] micro-batch whose rows may be trees."""
    parents: torch.Tensor  # [B, T] long: the position whose hidden state predicts each token (-1 at a root)
    positions: torch.Tensor  # [B, T] long: each token's position in its own sequence
    attention: torch.Tensor  # [B, 1, T, T] bool: True where a token may attend

    @classmethod
    def of(cls, row_parents: Sequence[Sequence[int] | None], width: int, device: torch.device) -> TreeRows:
        """From each row's parents (None: a plain sequence, parent i - 1)."""
        parents = torch.empty((len(row_parents), width), dtype=torch.long)
        positions = torch.empty_like(parents)
        attention = torch.empty((len(row_parents), 1, width, width), dtype=torch.bool)
        for row, given in enumerate(row_parents):
            chain = list(range(-1, width - 1))
            row_list = list(given) + chain[len(given):] if given is not None else chain
            parents[row] = torch.tensor(row_list)
            positions[row] = torch.tensor(depths(row_list))
            attention[row, 0] = ancestor_mask(row_list, width)
        return cls(parents.to(device), positions.to(device), attention.to(device))

    def shared_prefix_limit(self) -> int:
        """How many leading positions are one plain chain in every row (what rows may share as a KV-cache prefix)."""
        chain = torch.arange(-1, self.parents.shape[1] - 1, device=self.parents.device)
        plain = (self.parents == chain).all(dim=0)
        return int(plain.long().cumprod(dim=0).sum())
