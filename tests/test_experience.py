"""batching.py, advantages.py and experience.py's sampler correction: episode sequences, micro-batches, turn-level
credit, loss weights, on hand-built episodes."""
import pytest
import torch

from ppo_affine.envs.tasks import Task
from ppo_affine.advantages import _loss_weights, assign_advantages
from ppo_affine.batching import build_sequences, collate, plan_micro_batches
from ppo_affine.experience import batch_cost, correct_for_the_sampler
from ppo_affine.rollout import Episode, Turn
from ppo_affine.config import PPOConfig

PROMPT, GLUE = [1, 2, 3], [4, 5]


def played(score: float, turns: int, reply_len: int, game: str = "g", task_id: int = 0) -> Episode:
    """An episode held in one sequence: prompt, then per turn a reply and the glue to the next turn."""
    sequence, episode_turns = list(PROMPT), []
    for t in range(turns):
        if t:
            sequence += GLUE
        episode_turns.append(Turn([7] * reply_len, "7", None, sequence=0, start=len(sequence)))
        sequence += [7] * reply_len
    return Episode(task=Task("e", task_id, 0, None, "s", False), env_kind="openspiel", turns=episode_turns,
                   sequences=[sequence], score=score, done=True, game_name=game)


def with_scores(sequences, values: float = 0.0):
    """Old/ref log-probs equal (KL 0) and a constant value everywhere."""
    for s in sequences:
        s.old_logprobs = torch.zeros(s.response_len)
        s.ref_logprobs = torch.zeros(s.response_len)
        s.old_values = torch.full((s.response_len,), values)
    return sequences


def first_turn_advantage(sequence) -> float:
    return float(sequence.advantages[sequence.span_slices()[0]][0])


def test_an_append_only_episode_is_one_sequence_with_a_span_per_turn():
    episode = played(1.0, turns=3, reply_len=2)
    [sequence] = build_sequences([episode])
    assert sequence.input_ids == [1, 2, 3, 7, 7, 4, 5, 7, 7, 4, 5, 7, 7]
    assert sequence.spans == [(3, 5), (7, 9), (11, 13)] and sequence.turns == [0, 1, 2]
    batch = collate([sequence], pad_id=0, device=torch.device("cpu"))
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]]


def test_turns_in_separate_sequences_become_separate_training_rows():
    episode = Episode(task=Task("e", 0, 0, None, "s", False), env_kind="openspiel", done=True,
                      turns=[Turn([7, 8], "", None, sequence=0, start=2), Turn([9], "", None, sequence=1, start=3)],
                      sequences=[[1, 2, 7, 8], [1, 2, 5, 9]])
    first, second = build_sequences([episode])
    assert (first.input_ids, first.spans, second.input_ids, second.spans) == ([1, 2, 7, 8], [(2, 4)],
                                                                              [1, 2, 5, 9], [(3, 4)])


@pytest.mark.parametrize("reply_len", [200, 3])
def test_turn_credit_reaches_the_first_turn_of_a_long_episode(reply_len):
    # 7 turns, reward only at the end, values 0, gamma 1, lambda 0.95 per turn:
    # won: A_t = 0.95^(6-t) (first turn 0.735), lost: 0 -> after whitening won > 0 > lost
    won, lost = played(1.0, 7, reply_len), played(0.0, 7, reply_len)
    sequences = with_scores(build_sequences([won, lost]))
    cfg = PPOConfig(whiten_advantages=False)
    assign_advantages(sequences, [won, lost], cfg, kl_coef=0.0, group_ids=None)
    assert first_turn_advantage(sequences[0]) == pytest.approx(0.95**6, abs=1e-6)
    assert first_turn_advantage(sequences[1]) == 0.0
    # every token of a turn carries the turn's advantage
    assert torch.all(sequences[0].advantages[: reply_len] == sequences[0].advantages[0])
    with_scores(sequences)
    assign_advantages(sequences, [won, lost], PPOConfig(), kl_coef=0.0, group_ids=None)
    assert first_turn_advantage(sequences[0]) > 0.5 and first_turn_advantage(sequences[1]) < -0.5


def test_token_credit_with_long_replies_barely_reaches_the_first_turn():
    # the failure mode turn credit fixes: lambda 0.95 per token, 6 x 200 tokens between the outcome and turn 1
    won, lost = played(1.0, 7, 200), played(0.0, 7, 200)
    sequences = with_scores(build_sequences([won, lost]))
    assign_advantages(sequences, [won, lost], PPOConfig(credit="token", whiten_advantages=False), 0.0, None)
    assert first_turn_advantage(sequences[0]) < 1e-4


def test_turn_values_are_read_at_each_turns_first_token_and_returns_trained_there():
    # values 0.5 at every token; won: turn rewards [0, 0, 1], gamma 1, lambda 0.5
    # deltas: d0 = 0.5 - 0.5 = 0, d1 = 0, d2 = 1 - 0.5 = 0.5
    # A2 = 0.5, A1 = 0 + 0.5 * 0.5 = 0.25, A0 = 0 + 0.5 * 0.25 = 0.125; returns = A + 0.5
    episode = played(1.0, 3, 2)
    sequences = with_scores(build_sequences([episode]), values=0.5)
    assign_advantages(sequences, [episode], PPOConfig(lam=0.5, whiten_advantages=False), 0.0, None)
    [s] = sequences
    assert s.advantages.tolist() == pytest.approx([0.125, 0.125, 0.25, 0.25, 0.5, 0.5])
    assert s.returns.tolist() == pytest.approx([0.625, 0, 0.75, 0, 1.0, 0])
    assert s.value_weights.tolist() == pytest.approx([1 / 3, 0, 1 / 3, 0, 1 / 3, 0])


def test_turn_reward_includes_the_kl_summed_over_the_turns_tokens():
    # one turn of 4 tokens, KL (k1) 0.25 per token, beta 0.5: reward 1 - 0.5 * 1.0 = 0.5
    episode = played(1.0, 1, 4)
    sequences = with_scores(build_sequences([episode]))
    sequences[0].old_logprobs = torch.full((4,), -1.0)
    sequences[0].ref_logprobs = torch.full((4,), -1.25)
    stats = assign_advantages(sequences, [episode], PPOConfig(whiten_advantages=False), 0.5, None)
    assert sequences[0].advantages.tolist() == pytest.approx([0.5] * 4)
    assert stats["reward/kl_per_token"] == pytest.approx(0.25) and stats["reward/kl_per_episode"] == pytest.approx(1.0)


def test_loss_weights_per_token_episode_and_game():
    # three episodes of 6, 2 and 4 tokens; games a, a, b
    mask = torch.tensor([[1.0] * 6, [1.0] * 2 + [0.0] * 4, [1.0] * 4 + [0.0] * 2])
    games = ["a", "a", "b"]
    assert torch.equal(_loss_weights(mask, games, "token"), mask)
    episode = _loss_weights(mask, games, "episode")
    assert episode.sum(dim=1).tolist() == pytest.approx([1, 1, 1]) and float(episode[0, 0]) == pytest.approx(1 / 6)
    game = _loss_weights(mask, games, "game")
    assert game.sum(dim=1).tolist() == pytest.approx([0.5, 0.5, 1.0])
    assert float(game[0, 0]) == pytest.approx(1 / 12) and float(game[2, 5]) == 0.0


def test_a_sixty_turn_episode_weighs_as_much_as_a_two_turn_one():
    long, short = played(1.0, 60, 3, task_id=1), played(0.0, 2, 3, task_id=2)
    sequences = with_scores(build_sequences([long, short]))
    assign_advantages(sequences, [long, short], PPOConfig(), 0.0, None)
    assert float(sequences[0].token_weights.sum()) == pytest.approx(float(sequences[1].token_weights.sum()))
    assign_advantages(sequences, [long, short], PPOConfig(loss_weighting="token"), 0.0, None)
    assert float(sequences[0].token_weights.sum()) == 30 * float(sequences[1].token_weights.sum())


def test_group_advantages_are_the_normalised_episode_return_on_every_token():
    a, b = played(1.0, 2, 2), played(0.0, 2, 2)
    sequences = with_scores(build_sequences([a, b]))
    assign_advantages(sequences, [a, b], PPOConfig(advantage="group", group_size=2, batch_size=2), 0.0, [0, 0])
    # returns 1 and 0: mean 0.5, sample std 0.7071 -> +-0.7071
    assert sequences[0].advantages.tolist() == pytest.approx([0.70710] * 4, abs=1e-4)
    assert sequences[1].advantages.tolist() == pytest.approx([-0.70710] * 4, abs=1e-4)
    assert float(sequences[0].value_weights.sum()) == 0.0


def test_micro_batches_without_sharing_respect_the_budget_and_keep_padding_small():
    lengths = [100, 90, 400, 95, 410, 105]
    groups = plan_micro_batches([[i] * n for i, n in enumerate(lengths)], budget=420, share_prefixes=False)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) == 1 or max(lengths[i] for i in group) * len(group) <= 420
    assert [sorted(lengths[i] for i in g) for g in groups] == [[90, 95, 100, 105], [400], [410]]


def test_micro_batches_gather_the_rows_that_begin_alike_and_count_their_prefix_once():
    system_a, system_b = [1] * 50, [2] * 50
    group = system_a + [3] * 100  # a group's first observation: 150 shared tokens
    sequences = [group + [7] * 20, system_b + [4] * 30, group + [8] * 25, group + [9] * 10, system_b + [5] * 30]
    # group rows: 150 + 3 x 25 = 225 tokens; the system_b rows: 50 + 2 x 30 = 110; all five in one: 5 x 175
    groups = plan_micro_batches(sequences, budget=400)
    assert sorted(sorted(g) for g in groups) == [[0, 2, 3], [1, 4]]


def test_a_row_that_would_cut_the_shared_prefix_short_starts_a_new_micro_batch():
    group = [1] * 200
    sequences = [group + [7] * 10, group + [8] * 10, [1] * 20 + [6] * 190]
    # rows 0 and 1 cost 200 + 2 x 10 = 220 tokens, row 2 alone 210: 430 + 2 calls; all three (20 tokens in
    # common) 20 + 3 x 190 = 590 + 1 call (a call counts as prefixes.CALL_OVERHEAD = 128 tokens)
    groups = plan_micro_batches(sequences, budget=10_000)
    assert sorted(sorted(g) for g in groups) == [[0, 1], [2]]
    assert plan_micro_batches(sequences, budget=10_000, share_prefixes=False) == [[0, 1, 2]]


def test_batch_cost_counts_a_shared_prefix_once():
    rows = torch.tensor([[1] * 40 + [2, 3, 0], [1] * 40 + [4, 0, 0]])
    assert batch_cost(rows) == 40 + 2 * 3
    assert batch_cost(torch.tensor([[1, 2, 3], [4, 5, 6]])) == 6




def test_sampler_correction_weighs_the_tokens_vllm_sampled_and_leaves_the_trainers_own_at_one():
    # sampled by vLLM: log pi_old - log pi_vllm = [0.5, 2.5, -1] -> weights [e^0.5, 2 (capped), e^-1]
    # = [1.6487213, 2, 0.3678794]: mean 1.3388669, one of three capped
    vllm = Episode(task=Task("e", 0, 0, None, "s", False), env_kind="openspiel", done=True,
                   turns=[Turn([7, 8, 9], "", [-1.5, -3.0, -1.0], sequence=0, start=2)], sequences=[[1, 2, 7, 8, 9]])
    local = played(1.0, turns=1, reply_len=2)  # sampled by the trainer: no sampler log-probs
    sampled, own = build_sequences([vllm, local])
    sampled.old_logprobs, own.old_logprobs = torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-1.0, -1.0])
    stats = correct_for_the_sampler([sampled, own], cap=2.0)
    torch.testing.assert_close(sampled.importance_weights, torch.tensor([1.6487213, 2.0, 0.3678794]))
    assert own.importance_weights.tolist() == [1.0, 1.0]
    assert stats == pytest.approx({"tis/weight_mean": 1.3388669, "tis/clip_fraction": 1 / 3})
    batch = collate([sampled, own], pad_id=0, device=torch.device("cpu"))
    torch.testing.assert_close(batch.importance_weights,
                               torch.tensor([[0, 0, 1.6487213, 2.0, 0.3678794], [0, 0, 0, 1.0, 1.0]]))


def test_without_tokens_from_another_sampler_there_is_nothing_to_report():
    [sequence] = build_sequences([played(1.0, turns=1, reply_len=2)])
    sequence.old_logprobs = torch.zeros(2)
    assert correct_for_the_sampler([sequence], cap=2.0) == {}
