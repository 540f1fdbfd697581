"""Training sequences and the micro-batches every pass runs them in.

The unit of scoring, the update and SFT is a `TrainSequence`: one token sequence of an episode with
every turn it holds (prompt and observation tokens masked, each reply's tokens trained). When the chat
template renders the conversation append-only (`prompts.TokenHistory`), a whole episode is one
sequence and every token is processed once; otherwise a turn starts a new sequence, and `as_trees` merges an
episode's sequences into one prefix tree (`token_trees.py`) so that their shared history is processed once too.

`micro_batches` is the one loop over micro-batches of a token budget (`plan_micro_batches` groups the
sequences, `collate` pads each group into a `Batch`); scoring, both passes of the update and SFT use it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ppo_affine.prefixes import common_prefix, padded_cost, partition
from ppo_affine.rollout import Episode
from ppo_affine.token_trees import TreeBuilder, TreeRows, chain_length


@dataclass
class TrainSequence:
    episode: int  # index into the batch's episodes
    input_ids: list[int]
    spans: list[tuple[int, int]]  # [start, end) of each turn's reply tokens, in turn order
    turns: list[int]  # the episode's turn index of each span
    sampler_logprobs: list[float] | None = None
    # A tree of several sequences (`as_trees`): per token, the index of the token before it in its own sequence
    # (-1 at the root). None: a plain sequence.
    parents: list[int] | None = None
    # Per reply token, the spans concatenated in order: [R]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # of the rollout policy, for logging
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None  # policy-loss weight of each reply token
    importance_weights: torch.Tensor | None = None  # min(pi_trainer_old / pi_sampler, C) (ppo.sampler_correction)
    value_weights: torch.Tensor | None = None  # value-loss weight; 0 where no value is trained

    @property
    def response_len(self) -> int:
        return sum(end - start for start, end in self.spans)

    def span_slices(self) -> list[slice]:
        """Each turn's slice of the per-reply-token tensors."""
        slices, position = [], 0
        for start, end in self.spans:
            slices.append(slice(position, position + end - start))
            position += end - start
        return slices


def build_sequences(episodes: list[Episode]) -> list[TrainSequence]:
    """Every episode's token sequences that hold at least one reply token, in episode order."""
    sequences = []
    for e, episode in enumerate(episodes):
        by_sequence: dict[int, list[int]] = {}
        for t, turn in enumerate(episode.turns):
            if turn.response_ids:
                by_sequence.setdefault(turn.sequence, []).append(t)
        for s, turn_indices in sorted(by_sequence.items()):
            turns = [episode.turns[t] for t in turn_indices]
            spans = [(turn.start, turn.start + len(turn.response_ids)) for turn in turns]
            sampler = None
            if all(turn.sampler_logprobs is not None for turn in turns):
                sampler = [lp for turn in turns for lp in turn.sampler_logprobs]
            sequences.append(TrainSequence(episode=e, input_ids=episode.sequences[s][: spans[-1][1]], spans=spans,
                                           turns=turn_indices, sampler_logprobs=sampler))
    return sequences


def as_trees(sequences: list[TrainSequence], token_budget: int) -> list[TrainSequence]:
    """Each episode's sequences merged into prefix trees, in their order (a tree takes the place of its first
    sequence). A tree holds at most max(`token_budget`, the longest of `sequences`) tokens: a micro-batch never
    holds more tokens than the largest one of the sequences scored one by one (a sequence longer than the budget
    gets one of its own). Where an episode needs more than one tree, each tree runs its own copy of the history
    its sequences share. Trees are therefore filled from the episode's last sequence backwards: the last one holds
    the whole history, so its tree takes as many of the latest turns as fit, and what is left for the next tree
    are the earliest turns, whose histories are the shortest (filled forwards, the last turns were left alone
    with a history of nearly full length to run again). A tree of one sequence is that sequence, unchanged. Call
    before anything is scored: per-token fields are not carried over."""
    by_episode: dict[int, list[TrainSequence]] = {}
    for sequence in sequences:
        if sequence.old_logprobs is not None or sequence.parents is not None:
            raise ValueError("as_trees merges plain sequences before they are scored")
        by_episode.setdefault(sequence.episode, []).append(sequence)
    token_budget = max([token_budget, *(len(s.input_ids) for s in sequences)])
    merged = []
    for members in by_episode.values():
        groups: list[list[TrainSequence]] = []
        builder = None
        for member in reversed(members):
            if builder is None or len(builder.tokens) + builder.added_tokens(member.input_ids, member.spans) \
                    > token_budget:
                builder = TreeBuilder()
                groups.append([])
            builder.add(member.input_ids, member.spans)
            groups[-1].append(member)
        merged.extend(_tree_sequence(group[::-1]) for group in reversed(groups))
    return merged  # episodes in the order they first appear, each episode's trees in its sequences' order


TREE_MIN_SAVING = 0.25  # trees run only when they cut the tokens through the model by at least this fraction


def scoring_sequences(sequences: list[TrainSequence], token_budget: int, mode: str) -> list[TrainSequence]:
    """The sequences as scoring, the update and SFT run them under `ppo.tree_scoring` (`mode`): as they are
    (off), as trees (always), or as trees where they pay (auto)."""
    if mode == "off":
        return sequences
    if mode == "always":
        return as_trees(sequences, token_budget)
    return with_trees_where_they_pay(sequences, token_budget)


def with_trees_where_they_pay(sequences: list[TrainSequence], token_budget: int) -> list[TrainSequence]:
    """`as_trees(sequences)` when its micro-batches put at least TREE_MIN_SAVING fewer tokens through the model
    than the sequences' own (which already run a prefix shared by a micro-batch's rows once, such as a two-turn
    episode's history); else the sequences as they are. A tree's branches attend by a mask, which on two CPU
    cores cost more than a fifth fewer tokens saved (docs/benchmarks.md, "Reasoned turns as one tree")."""
    trees = as_trees(sequences, token_budget)
    if len(trees) == len(sequences):
        return sequences
    if planned_tokens(trees, token_budget) <= (1 - TREE_MIN_SAVING) * planned_tokens(sequences, token_budget):
        return trees
    return sequences


def planned_tokens(sequences: list[TrainSequence], token_budget: int) -> int:
    """Tokens the micro-batches of `sequences` put through the model: padding included, a prefix shared by a
    micro-batch's rows counted once (for tree rows, as far as every row is one plain chain)."""
    total = 0
    for rows in plan_micro_batches([s.input_ids for s in sequences], token_budget):
        members = [sequences[i] for i in rows]
        shared = min(common_prefix(members[0].input_ids, m.input_ids) for m in members)
        shared = min([shared, *(chain_length(m.parents) for m in members if m.parents is not None)])
        total += padded_cost(len(members), shared, max(len(m.input_ids) for m in members))
    return total


def _tree_sequence(group: list[TrainSequence]) -> TrainSequence:
    """One sequence, or several merged into one tree sequence. The longest goes in first: it holds the history
    every other one repeats, so the tree begins with one plain chain of it (`Policy` runs that chain causally, with
    no mask) and the other sequences' own parts are short branches after it. Spans are listed by position, each
    with its turn (turn order is not position order) and its sampler log-probs."""
    if len(group) == 1:
        return group[0]
    longest = max(range(len(group)), key=lambda i: len(group[i].input_ids))
    order = [longest] + [i for i in range(len(group)) if i != longest]
    builder = TreeBuilder()
    for i in order:
        builder.add(group[i].input_ids, group[i].spans)
    turns = [turn for i in order for turn in group[i].turns]
    spans = builder.spans
    by_position = sorted(range(len(spans)), key=lambda k: spans[k][0])
    sampler = None
    if all(member.sampler_logprobs is not None for member in group):
        per_span = [part for i in order for part in _per_span(group[i].sampler_logprobs, group[i].spans)]
        sampler = [lp for k in by_position for lp in per_span[k]]
    return TrainSequence(episode=group[0].episode, input_ids=builder.tokens, spans=[spans[k] for k in by_position],
                         turns=[turns[k] for k in by_position], sampler_logprobs=sampler, parents=builder.parents)


def _per_span(values: list[float], spans: list[tuple[int, int]]) -> list[list[float]]:
    """A per-reply-token list cut into one list per span."""
    parts, position = [], 0
    for start, end in spans:
        parts.append(values[position:position + end - start])
        position += end - start
    return parts


def plan_micro_batches(token_ids: list[list[int]], budget: int, share_prefixes: bool = True) -> list[list[int]]:
    """Indices grouped into micro-batches that each put at most `budget` tokens through the model (right
    padding included; a sequence longer than the budget gets a micro-batch of its own).

    With `share_prefixes` (the policy runs a micro-batch's common prefix once, see `Policy.score`) the
    sequences that begin alike, such as one game's rules or a group's episodes of one task and seed,
    go together, and the split is the one that processes the fewest tokens (`prefixes.partition`).
    Without, sequences sorted by length fill micro-batches up to rows x longest <= budget."""
    if share_prefixes:
        def cost(rows: int, shared: int, longest: int) -> int | None:
            tokens = padded_cost(rows, shared, longest)
            return tokens if tokens <= budget else None

        return [rows for rows, _ in partition(token_ids, cost)]
    groups: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(token_ids)), key=lambda i: len(token_ids[i])):
        # sorted ascending: the newest member is the longest
        if current and len(token_ids[index]) * (len(current) + 1) > budget:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    return groups


@dataclass
class Batch:
    """One right-padded micro-batch, row r holding `sequences[r]`. Right padding needs no attention mask: causal
    attention never looks at the padding after a row. A per-reply-token field sits at the row's reply positions
    (0 elsewhere), and is None when the sequences do not carry it yet (scoring and SFT read the tokens alone)."""
    sequences: list[TrainSequence]
    input_ids: torch.Tensor  # [B, T] long, padded with the pad id
    response_mask: torch.Tensor  # [B, T] 1 at reply tokens
    old_logprobs: torch.Tensor | None  # [B, T]
    ref_logprobs: torch.Tensor | None  # [B, T]
    old_values: torch.Tensor | None  # [B, T]
    advantages: torch.Tensor | None  # [B, T]
    returns: torch.Tensor | None  # [B, T]
    token_weights: torch.Tensor | None  # [B, T]
    value_weights: torch.Tensor | None  # [B, T]
    importance_weights: torch.Tensor | None  # [B, T]
    tree: TreeRows | None = None  # when a row is a tree: which positions attend to which


def collate(sequences: list[TrainSequence], pad_id: int, device: torch.device) -> Batch:
    """`sequences` as one `Batch` on `device`. A per-reply-token field that some of the sequences carry and others
    do not is an error: a zero in its place would train on a number nobody computed."""
    width = max(len(s.input_ids) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(sequences), width), dtype=torch.float32)
    positions = [torch.cat([torch.arange(start, end) for start, end in s.spans]) for s in sequences]
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence.input_ids)] = torch.tensor(sequence.input_ids)
        response_mask[row, positions[row]] = 1

    def per_token(name: str, values: list[torch.Tensor | None]) -> torch.Tensor | None:
        """[R] tensors of each row at its reply positions in a [B, T] tensor; None when no row has one."""
        if all(value is None for value in values):
            return None
        if any(value is None for value in values):
            raise ValueError(f"{name} is set on {sum(v is not None for v in values)} of {len(values)} sequences: "
                             "score every sequence and assign its advantages before an update collates it")
        placed = torch.zeros((len(sequences), width), dtype=torch.float32)
        for row, value in enumerate(values):
            placed[row, positions[row]] = value
        return placed.to(device)

    return Batch(
        sequences=sequences, input_ids=input_ids.to(device), response_mask=response_mask.to(device),
        old_logprobs=per_token("old_logprobs", [s.old_logprobs for s in sequences]),
        ref_logprobs=per_token("ref_logprobs", [s.ref_logprobs for s in sequences]),
        old_values=per_token("old_values", [s.old_values for s in sequences]),
        advantages=per_token("advantages", [s.advantages for s in sequences]),
        returns=per_token("returns", [s.returns for s in sequences]),
        token_weights=per_token("token_weights", [s.token_weights for s in sequences]),
        value_weights=per_token("value_weights", [s.value_weights for s in sequences]),
        importance_weights=per_token("importance_weights", [s.importance_weights for s in sequences]),
        tree=(TreeRows.of([s.parents for s in sequences], width, device)
              if any(s.parents is not None for s in sequences) else None),
    )


def micro_batches(sequences: list[TrainSequence], token_budget: int, pad_id: int, device: torch.device,
                  share_prefixes: bool = True) -> Iterator[Batch]:
    """`sequences` in micro-batches of at most `token_budget` tokens through the model (`plan_micro_batches`),
    each collated; `share_prefixes` as there (False where gradient checkpointing keeps a pass from sharing)."""
    for rows in plan_micro_batches([s.input_ids for s in sequences], token_budget, share_prefixes):
        yield collate([sequences[i] for i in rows], pad_id, device)
