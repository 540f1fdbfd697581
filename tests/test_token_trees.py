"""Prefix trees of an episode's sequences: the flat layout by hand, and tree scoring equal to per-turn scoring
(log-probs, values, entropies, losses and adapter gradients) on conversations whose template strips reasoning."""
from __future__ import annotations

import pytest
import torch

from ppo_affine.batching import TrainSequence, as_trees, collate
from ppo_affine.token_trees import TreeBuilder, TreeRows, ancestor_mask, depths, unique_token_count


def test_a_later_sequence_shares_its_history_and_branches_off_before_its_reply():
    builder = TreeBuilder()
    builder.add([1, 2, 3, 4], [(3, 4)])  # prompt 1 2 3, reply 4
    builder.add([1, 2, 3, 5, 6, 7], [(5, 6)])  # same prompt, the reply shown stripped (5), then 6, reply 7
    assert builder.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert builder.parents == [-1, 0, 1, 2, 2, 4, 5]  # 5 hangs off 3, not off the first reply 4
    assert builder.spans == [(3, 4), (6, 7)]
    assert depths(builder.parents) == [0, 1, 2, 3, 3, 4, 5]


def test_trained_tokens_are_never_shared():
    """The second sequence repeats the first one's reply token (4) as context, but its own span starts at 3: the
    shared walk stops there, so token 4 is trained once, by the first sequence."""
    builder = TreeBuilder()
    builder.add([1, 2, 3, 4], [(3, 4)])
    builder.add([1, 2, 3, 4], [(3, 4)])
    assert builder.tokens == [1, 2, 3, 4, 4] and builder.parents == [-1, 0, 1, 2, 2]
    assert builder.spans == [(3, 4), (4, 5)]
    builder.add([1, 2, 3, 4, 9], [(4, 5)])  # context 1 2 3 4 may go through the first branch
    assert builder.tokens[-1] == 9 and builder.parents[-1] == 3


def test_ancestor_mask_by_hand():
    # 0 -> 1 -> 2 and 1 -> 3 -> 4, then one padding position continuing from 4
    mask = ancestor_mask([-1, 0, 1, 1, 3], 6).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [1, 1, 0, 1, 1, 1],
    ]


def test_unique_tokens_count_each_shared_prefix_once():
    assert unique_token_count([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]) == 4 + 2 + 1
    assert unique_token_count([[1, 2], [1, 2]]) == 2
    assert unique_token_count([]) == 0


def test_rows_share_a_prefix_only_where_every_row_is_one_chain():
    rows = TreeRows.of([[-1, 0, 1, 1], None], 5, torch.device("cpu"))
    assert rows.positions.tolist() == [[0, 1, 2, 2, 3], [0, 1, 2, 3, 4]]
    assert rows.shared_prefix_limit() == 3


def _sequence(episode: int, ids: list[int], spans, turns) -> TrainSequence:
    return TrainSequence(episode=episode, input_ids=list(ids), spans=list(spans), turns=list(turns))


def test_as_trees_merges_by_episode_and_cuts_at_the_budget():
    a0 = _sequence(0, [1, 2, 3, 4], [(3, 4)], [0])
    a1 = _sequence(0, [1, 2, 3, 5, 6, 7], [(5, 6)], [1])
    a2 = _sequence(0, [1, 2, 3, 5, 6, 8, 9, 10], [(7, 8)], [2])
    b0 = _sequence(1, [1, 2, 11], [(2, 3)], [0])
    merged = as_trees([a0, a1, a2, b0], token_budget=100)
    assert [s.episode for s in merged] == [0, 1] and merged[1] is b0  # one sequence stays as it is
    # the longest (a2, the whole history) first, as one chain; then each other one's own tokens as a branch
    assert merged[0].input_ids == [1, 2, 3, 5, 6, 8, 9, 10, 4, 7]
    assert merged[0].parents == [-1, 0, 1, 2, 3, 4, 5, 6, 2, 4]
    assert merged[0].spans == [(7, 8), (8, 9), (9, 10)] and merged[0].turns == [2, 0, 1]
    # a budget of 8 tokens (the longest sequence's length): the first two make a tree of 7, the third would add
    # 3 more and starts a tree of its own
    cut = as_trees([a0, a1, a2], token_budget=4)
    assert [s.turns for s in cut] == [[1, 0], [2]] and cut[1] is a2
    assert [s.turns for s in as_trees([a0, a1, a2], token_budget=10)] == [[2, 0, 1]]
    for sequence, logprob in ((a0, -0.1), (a1, -0.2), (a2, -0.3)):  # the sampler's, in the spans' new order
        sequence.sampler_logprobs = [logprob]
    assert as_trees([a0, a1, a2], token_budget=10)[0].sampler_logprobs == [-0.3, -0.1, -0.2]


def test_an_episode_cut_into_trees_leaves_its_earliest_turns_to_the_second_one():
    """Each tree runs its own copy of the shared history: the last sequence's tree takes the latest turns, so
    the tree that runs the history again holds the earliest turns, whose history is the shortest."""
    r0, r1, r2, r3, x0, x1, x2 = 90, 91, 92, 93, 80, 81, 82  # replies as sampled; x: as the next turn shows them
    s0 = _sequence(0, [1, 2, r0], [(2, 3)], [0])
    s1 = _sequence(0, [1, 2, x0, 3, 4, r1], [(5, 6)], [1])
    s2 = _sequence(0, [1, 2, x0, 3, 4, x1, 5, 6, r2], [(8, 9)], [2])
    s3 = _sequence(0, [1, 2, x0, 3, 4, x1, 5, 6, x2, 7, 8, r3], [(11, 12)], [3])
    trees = as_trees([s0, s1, s2, s3], token_budget=14)
    # the whole history (12 tokens) and the replies of turns 1 and 2 as branches make 14; turn 0 goes alone (3
    # tokens). Filled from the first turn on, turns 0-2 would make a tree of 11 and turn 3 one of 12: 23 in all.
    assert [t.turns for t in trees] == [[0], [3, 1, 2]] and trees[0] is s0
    assert sum(len(t.input_ids) for t in trees) == 3 + 14
    assert trees[1].input_ids == s3.input_ids + [r1, r2]


# A Qwen3-style template: every earlier assistant message is shown without its reasoning.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].strip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REPLIES = ["<think>the opponent bid high, so I hold</think>2", "<think>one card left; play it</think> 0 ",
           "<think>raise: the pot is small</think>1", "<think>nothing better</think>3"]


def reasoned_conversations(tokenizer, games: int = 2) -> list[TrainSequence]:
    """Per turn, one sequence: the conversation so far as the template shows it (earlier reasons gone), then the
    raw reply with its reasoning and EOS; as the rollout makes them when history is stripped."""
    sequences = []
    for game in range(games):
        messages = [{"role": "system", "content": "You play a card game. Reply with an action ID."}]
        for turn, reply in enumerate(REPLIES[game:] + REPLIES[:game]):
            messages.append({"role": "user", "content": f"Turn {turn}: legal actions 0 1 2 3. Game {game}."})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   chat_template=STRIPPING_TEMPLATE)
            prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            reply_ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
            sequences.append(_sequence(game, prompt_ids + reply_ids,
                                       [(len(prompt_ids), len(prompt_ids) + len(reply_ids))], [turn]))
            messages.append({"role": "assistant", "content": reply})
    return sequences


def _fill_training_fields(sequences: list[TrainSequence]) -> None:
    """Advantages, returns and weights that depend on the turn and the token's place in its reply only, so the
    per-turn and the tree sequences carry the same numbers."""
    for sequence in sequences:
        parts = {name: [] for name in ("advantages", "returns", "token_weights", "value_weights",
                                       "importance_weights")}
        for (start, end), turn in zip(sequence.spans, sequence.turns):
            k = torch.arange(end - start, dtype=torch.float32)
            parts["advantages"].append(torch.sin(k + 3 * turn + 10 * sequence.episode))
            parts["returns"].append(torch.cos(k - turn))
            parts["token_weights"].append(1.0 + 0.1 * turn + 0 * k)
            parts["value_weights"].append((k == 0).float())  # one value per turn
            parts["importance_weights"].append(0.9 + 0.05 * torch.cos(k))
        for name, values in parts.items():
            setattr(sequence, name, torch.cat(values))


def _per_turn(sequences: list[TrainSequence], name: str) -> dict[tuple[int, int], torch.Tensor]:
    return {(s.episode, turn): getattr(s, name)[part] for s in sequences
            for part, turn in zip(s.span_slices(), s.turns)}


@pytest.mark.parametrize("advantage,checkpointing", [("gae", False), ("group", False), ("gae", True)])
def test_tree_scoring_equals_per_turn_scoring(tiny_policy, advantage, checkpointing):
    from ppo_affine.config import PPOConfig
    from ppo_affine.experience import score_sequences
    from ppo_affine.update import UpdateSettings, accumulate_gradients
    from ppo_affine.distributed import ONE_PROCESS

    if checkpointing:  # no KV cache in training passes: the tree runs as one call with its whole mask
        base = tiny_policy.model.get_base_model()
        if hasattr(base, "activation_checkpointing_enable"):  # transformers 5.2x's name (model_files.py)
            base.activation_checkpointing_enable({"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.config.use_cache = False
        assert not tiny_policy.shares_prefixes_with_gradients()
    torch.manual_seed(0)
    with torch.no_grad():  # a value head and LoRA B not zero, so every gradient means something
        tiny_policy.value_head.weight.normal_(0, 0.5)
        for name, parameter in tiny_policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    plain = reasoned_conversations(tiny_policy.tokenizer)
    trees = as_trees(reasoned_conversations(tiny_policy.tokenizer), token_budget=4096)
    assert len(plain) == 8 and len(trees) == 2 and all(t.parents is not None for t in trees)
    unique = sum(len(t.input_ids) for t in trees)
    assert unique < sum(len(s.input_ids) for s in plain)

    results = {}
    for name, sequences in (("plain", plain), ("tree", trees)):
        metrics = score_sequences(tiny_policy, sequences, 4096, temperature=1.0, with_values=True)
        assert metrics["perf/unique_tokens"] == unique  # the same count either way
        _fill_training_fields(sequences)
        cfg = PPOConfig(advantage=advantage, entropy_coef=0.01, micro_batch_tokens=4096)
        settings = UpdateSettings(cfg, kl_coef=0.05, temperature=1.0, micro_batch_tokens=4096, shuffle_seed=0)
        gradients = accumulate_gradients(tiny_policy, sequences, settings, ONE_PROCESS)  # eval mode: no dropout
        assert gradients.finite
        results[name] = {
            "processed": metrics["perf/tokens_processed"], "stats": gradients.stats,
            "grads": {n: p.grad.clone() for n, p in tiny_policy.named_parameters() if p.grad is not None},
            **{field: _per_turn(sequences, field) for field in ("old_logprobs", "ref_logprobs", "old_values",
                                                                "entropy")},
        }
    plain_result, tree_result = results["plain"], results["tree"]
    assert tree_result["processed"] < plain_result["processed"]
    for field in ("old_logprobs", "ref_logprobs", "old_values", "entropy"):
        assert plain_result[field].keys() == tree_result[field].keys()
        for key, value in plain_result[field].items():
            torch.testing.assert_close(tree_result[field][key], value, atol=1e-5, rtol=0, msg=f"{field} {key}")
    for key, value in plain_result["stats"].items():
        assert tree_result["stats"][key] == pytest.approx(value, abs=1e-5), key
    assert plain_result["grads"].keys() == tree_result["grads"].keys() and plain_result["grads"]
    for name, grad in plain_result["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(tree_result["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_tree_rows_share_the_system_prompt_across_a_micro_batch(tiny_policy):
    """Two episodes' trees in one micro-batch run their common system prompt once (as plain rows do) and still
    score as the per-turn sequences do."""
    from ppo_affine.experience import score_sequences

    plain = reasoned_conversations(tiny_policy.tokenizer)
    trees = as_trees(reasoned_conversations(tiny_policy.tokenizer), token_budget=4096)
    batch = collate(trees, tiny_policy.tokenizer.pad_token_id, tiny_policy.device)
    assert batch.tree.shared_prefix_limit() >= 16
    score_sequences(tiny_policy, plain, 4096, temperature=1.0, with_values=False)
    score_sequences(tiny_policy, trees, 4096, temperature=1.0, with_values=False)
    for key, value in _per_turn(plain, "old_logprobs").items():
        torch.testing.assert_close(_per_turn(trees, "old_logprobs")[key], value, atol=1e-5, rtol=0)


def test_sft_on_trees_takes_the_same_step(tiny_model_dir, monkeypatch):
    """One SFT step over a minibatch of every turn of two reasoned conversations: the same loss and the same new
    adapter with the turns as trees as with each turn whole (plain SGD, so the comparison is of the gradients)."""
    from ppo_affine.testing.tiny import load_tiny_policy
    from ppo_affine.warm_start.sft import train_sft

    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    results = []
    for trees in (False, True):
        policy = load_tiny_policy(tiny_model_dir)
        for module in policy.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        history = train_sft(policy, reasoned_conversations(policy.tokenizer), epochs=1, learning_rate=0.5,
                            batch_size=8, token_budget=4096, seed=0, trees="always" if trees else "off")
        after = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        assert any(not torch.equal(before[n], after[n]) for n in after)
        results.append((history[0]["loss"], after))
    (plain_loss, plain_after), (tree_loss, tree_after) = results
    assert tree_loss == pytest.approx(plain_loss, abs=1e-5)
    for name, value in plain_after.items():
        torch.testing.assert_close(tree_after[name], value, atol=1e-6, rtol=0, msg=name)


def test_auto_uses_trees_only_where_they_put_a_quarter_fewer_tokens_through_the_model():
    from ppo_affine.batching import planned_tokens, scoring_sequences

    history = list(range(100, 400))
    # five turns, each repeating a growing history before its own 5-token reply: as trees about a third the tokens
    long_episode = [_sequence(0, history[:60 * t + 40] + [900 + t] * 5, [(60 * t + 40, 60 * t + 45)], [t])
                    for t in range(5)]
    assert scoring_sequences(long_episode, 4096, "auto")[0].parents is not None
    # two turns whose common history the per-turn micro-batch already runs once: a tree saves a few tokens only
    short_episode = [_sequence(0, history[:200] + [901] * 5, [(200, 205)], [0]),
                     _sequence(0, history[:201] + [902] * 5, [(201, 206)], [1])]
    trees = scoring_sequences(short_episode, 4096, "always")
    assert len(trees) == 1 and planned_tokens(trees, 4096) > 0.75 * planned_tokens(short_episode, 4096)
    assert scoring_sequences(short_episode, 4096, "auto") is short_episode
    assert scoring_sequences(long_episode, 4096, "off") is long_episode
