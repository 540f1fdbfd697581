"""rollout.py: context strategies, prompt budget, batched waves, exact token ids, env failures."""
import asyncio
import uuid

import pytest

from ppo_affine.envs.tasks import Task
from ppo_affine.envs.base import EpisodeLost, step_result
from ppo_affine.generation import Generation, cut_at_eos
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import MAX_OUTAGE_REPLAYS, MAX_REPLAYS, RolloutRunner, build_messages
from ppo_affine.config import GenerationConfig

CONVERSATION = [
    {"role": "system", "content": "rules"},
    {"role": "user", "content": "turn 1"},
    {"role": "assistant", "content": "<think>long plan</think>3"},
    {"role": "user", "content": "turn 2"},
    {"role": "assistant", "content": "<think>oops</think>x"},
    {"role": "user", "content": "invalid, attempt 2 of 3"},
]


def test_full_strategy_is_the_whole_dialog_with_replies_as_the_validators_client_stores_them():
    shown = build_messages(CONVERSATION, 3, "full", "turn 2")
    assert [m["content"] for m in shown] == ["rules", "turn 1", "3", "turn 2", "x", "invalid, attempt 2 of 3"]
    assert [m["role"] for m in shown] == [m["role"] for m in CONVERSATION]


def test_truncated_strategy_replaces_earlier_thinking_with_a_marker():
    shown = build_messages(CONVERSATION, 3, "truncated", "turn 2")
    assert shown[2]["content"] == "<think>[earlier reasoning omitted]</think>3"
    assert shown[4]["content"] == "<think>oops</think>x"  # the pending decision's own attempt stays
    assert [m["role"] for m in shown] == [m["role"] for m in CONVERSATION]


def test_last_strategy_is_system_plus_the_pending_decision():
    shown = build_messages(CONVERSATION, 3, "last", "state now")
    assert shown == [CONVERSATION[0], {"role": "user", "content": "state now"}, CONVERSATION[4], CONVERSATION[5]]


def test_prompt_budget_drops_oldest_turns_but_keeps_system_and_pending_decision(tiny_policy):
    builder = PromptBuilder(tiny_policy.tokenizer, max_prompt_tokens=10_000)
    full = builder.encode(CONVERSATION)
    without_turn_1 = builder.encode(CONVERSATION[:1] + CONVERSATION[3:])
    builder.max_prompt_tokens = len(full) - 1
    assert builder.fit(CONVERSATION, keep_from=3)[::2] == (without_turn_1, 2)
    builder.max_prompt_tokens = len(builder.encode(CONVERSATION[:1] + CONVERSATION[3:])) - 1
    assert builder.fit(CONVERSATION, keep_from=3) is None


def test_generation_is_cut_after_the_first_eos():
    assert cut_at_eos([5, 6, 2, 0, 0], {2}) == [5, 6, 2]
    assert cut_at_eos([5, 6, 7], {2}) == [5, 6, 7]


class CountingEnv:
    """Two decisions per episode; the episode's score is 1 when both replies contained a digit."""

    def __init__(self, fail_task: int | None = None):
        self.episodes, self.fail_task = {}, fail_task

    async def reset(self, task_id=None, seed=None, **kwargs):
        if task_id == self.fail_task:
            raise ConnectionError("env server went away")
        episode_id = uuid.uuid4().hex
        self.episodes[episode_id] = []
        await asyncio.sleep(0.001 * (task_id % 3))  # uneven env latency must not change the waves
        return step_result("move 1?", episode_id=episode_id, info={"system_prompt": "sys", "turn_prompt": "move 1?",
                                                                     "game_name": "counting"})

    async def step(self, action, episode_id):
        self.episodes[episode_id].append(action)
        if len(self.episodes[episode_id]) == 2:
            score = float(all(any(c.isdigit() for c in a) for a in self.episodes[episode_id]))
            return step_result("over", reward=score, done=True, episode_id=episode_id,
                               info={"score": score, "success": score > 0.5, "game_name": "counting"})
        return step_result("move 2?", episode_id=episode_id, info={"turn_prompt": "move 2?", "game_name": "counting"})

    async def stop(self, episode_id):
        self.episodes.pop(episode_id, None)
        return {"status": "ok"}

    async def close(self):
        pass


def _runner(policy, env, concurrency=8, batching="continuous"):
    cfg = GenerationConfig(backend="local", max_new_tokens=3, max_concurrent_episodes=concurrency,
                           context_strategy="full", local_batching=batching)
    generator = LocalGenerator(policy, cfg, seed=0)
    return RolloutRunner({"game": ("openspiel", env)}, generator, PromptBuilder(policy.tokenizer, 4096), cfg)


def _tasks(n):
    return [Task("game", task_id=i, seed=i, opponent=None, stage="s", replay=False) for i in range(n)]


def _count_admissions(monkeypatch) -> tuple[list[int], list[int]]:
    """(rows joining at each forward call that admits some, rows of every forward call) of every LocalGenerator."""
    joined, rows = [], []
    step = LocalGenerator._launch_step

    def counting_step(self, joining):
        if joining:
            joined.append(len(joining))
        rows.append(len(joining) + (len(self._running.requests) if self._running else 0))
        return step(self, joining)

    monkeypatch.setattr(LocalGenerator, "_launch_step", counting_step)
    return joined, rows


def test_a_wave_batches_every_live_episodes_turn(tiny_policy, monkeypatch):
    joined, _ = _count_admissions(monkeypatch)
    episodes = asyncio.run(_runner(tiny_policy, CountingEnv(), batching="wave").run(_tasks(4), step=0))
    assert joined == [4, 4]  # 4 episodes x 2 decisions = 2 waves
    assert all(e.done and len(e.turns) == 2 for e in episodes)


def test_concurrency_limit_admits_new_episodes_as_others_finish(tiny_policy, monkeypatch):
    joined, decoded = _count_admissions(monkeypatch)
    episodes = asyncio.run(_runner(tiny_policy, CountingEnv(), concurrency=3).run(_tasks(5), step=0))
    assert max(decoded) <= 3 and sum(joined) == 10
    assert [e.task.task_id for e in episodes] == [0, 1, 2, 3, 4]


class SlowFirstMoveEnv(CountingEnv):
    """Task 0's first step takes 0.3 s (an opponent's long search); the env logs when each step returns."""

    def __init__(self):
        super().__init__()
        self.returned: list[tuple[int, int]] = []  # (task, its step number) in the order the steps returned
        self.task_of: dict[str, int] = {}

    async def reset(self, task_id=None, seed=None, **kwargs):
        result = await super().reset(task_id, seed, **kwargs)
        self.task_of[result["episode_id"]] = task_id
        return result

    async def step(self, action, episode_id):
        task = self.task_of[episode_id]
        if task == 0 and not self.episodes[episode_id]:
            await asyncio.sleep(0.3)
        result = await super().step(action, episode_id)
        self.returned.append((task, len(self.episodes[episode_id])))
        return result


@pytest.mark.parametrize("batching", ["continuous", "wave"])
def test_no_episode_waits_for_another_episodes_slow_env_step(tiny_policy, batching):
    env = SlowFirstMoveEnv()
    episodes = asyncio.run(_runner(tiny_policy, env, batching=batching).run(_tasks(4), step=0))
    assert all(e.done for e in episodes)
    others_done = max(env.returned.index((task, 2)) for task in (1, 2, 3))
    slow_first_move = env.returned.index((0, 1))
    if batching == "continuous":  # the other episodes played their second turns meanwhile
        assert others_done < slow_first_move
    else:  # the barrier: their second turns waited for episode 0's
        assert others_done > slow_first_move


def test_rollouts_are_reproducible_and_keep_exact_token_ids(tiny_policy):
    first = asyncio.run(_runner(tiny_policy, CountingEnv()).run(_tasks(6), step=3))
    second = asyncio.run(_runner(tiny_policy, CountingEnv()).run(_tasks(6), step=3))
    assert [[t.response_ids for t in e.turns] for e in first] == [[t.response_ids for t in e.turns] for e in second]
    for episode in first:
        for turn in episode.turns:
            assert tiny_policy.tokenizer.decode(turn.response_ids, skip_special_tokens=True) == turn.response_text
            assert episode.prompt_ids(turn)[-1] != tiny_policy.tokenizer.pad_token_id


def test_an_env_failure_fails_that_episode_and_the_others_finish(tiny_policy):
    episodes = asyncio.run(_runner(tiny_policy, CountingEnv(fail_task=2)).run(_tasks(4), step=0))
    assert "env server went away" in episodes[2].error and not episodes[2].turns
    assert all(e.done and not e.error for i, e in enumerate(episodes) if i != 2)


class LosingGenerator:
    """Replies "1", after losing the episode `losses` times (EpisodeLost, in an outage or not)."""

    def __init__(self, tokenizer, losses: int, outage: bool):
        self.reply = tokenizer("1", add_special_tokens=False)["input_ids"]
        self.eos_ids: set[int] = set()
        self.losses, self.outage = losses, outage

    async def generate(self, prompt_ids, order_key, seed):
        if self.losses:
            self.losses -= 1
            raise EpisodeLost("the server went away", outage=self.outage)
        return Generation(self.reply)


@pytest.mark.parametrize("outage,losses,fails", [(False, MAX_REPLAYS, False), (False, MAX_REPLAYS + 1, True),
                                                 (True, MAX_OUTAGE_REPLAYS, False),
                                                 (True, MAX_OUTAGE_REPLAYS + 1, True)])
def test_losses_in_outages_and_other_losses_each_have_their_own_replay_budget(tiny_policy, outage, losses, fails):
    cfg = GenerationConfig(max_new_tokens=3)
    generator = LosingGenerator(tiny_policy.tokenizer, losses, outage)
    runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, generator, PromptBuilder(tiny_policy.tokenizer, 4096),
                           cfg)
    [episode] = asyncio.run(runner.run(_tasks(1), step=0))
    assert episode.done != fails and bool(episode.error) == fails
    assert episode.replays == (losses - 1 if fails else losses)


@pytest.mark.parametrize("strategy", ["full", "truncated", "last"])
def test_prompts_follow_the_context_strategy(tiny_policy, strategy):
    runner = _runner(tiny_policy, CountingEnv())
    runner.cfg.context_strategy = strategy
    episode = asyncio.run(runner.run(_tasks(1), step=0))[0]
    second_prompt = tiny_policy.tokenizer.decode(episode.prompt_ids(episode.turns[1]))
    assert "move 2?" in second_prompt and "sys" in second_prompt
    assert ("move 1?" in second_prompt) == (strategy != "last")


class ScriptedGenerator:
    """Always replies with the token ids of one text (no EOS)."""

    eos_ids: set[int] = set()

    def __init__(self, tokenizer, text: str):
        self.token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, prompt_ids, order_key, seed):
        return Generation(list(self.token_ids))


@pytest.mark.parametrize("validator_conversation", [True, False])
def test_every_prompt_shows_the_conversation_the_validators_client_keeps(tiny_policy, validator_conversation):
    env, builder = CountingEnv(), PromptBuilder(tiny_policy.tokenizer, 4096)
    generator = ScriptedGenerator(tiny_policy.tokenizer, "<think>plan</think> 7 \n")
    runner = RolloutRunner({"game": ("openspiel", env)}, generator, builder,
                           GenerationConfig(backend="local", context_strategy="full"),
                           validator_conversation=validator_conversation)
    episode = asyncio.run(runner.run(_tasks(1), step=0))[0]
    replies = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    # in training and in evaluation alike, the second prompt shows the first reply whitespace- and
    # think-stripped, rendered afresh: the sampled "<think>plan</think> 7 \n" cannot continue the sequence
    stripped = episode.messages[:2] + [{"role": "assistant", "content": "7"}, episode.messages[3]]
    assert episode.prompt_ids(episode.turns[1]) == builder.encode(stripped) and len(episode.sequences) == 2
    first = episode.turns[0]
    assert episode.sequences[0] == episode.prompt_ids(first) + first.response_ids  # the reply trained as sampled
    if validator_conversation:
        # sent and stored stripped, as their client returns it
        assert list(env.episodes.values()) == [["7", "7"]] and replies == ["7", "7"]
    else:
        # training sends and keeps what the model wrote (the env strips reasoning itself where Affine's does)
        assert list(env.episodes.values()) == [["<think>plan</think> 7 \n"] * 2]
        assert replies == ["<think>plan</think> 7 \n"] * 2


def test_a_reply_the_client_keeps_as_it_is_continues_the_sampled_sequence(tiny_policy):
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, ScriptedGenerator(tiny_policy.tokenizer, "7"),
                           builder, GenerationConfig(backend="local", context_strategy="full"))
    episode = asyncio.run(runner.run(_tasks(1), step=0))[0]
    first, second = episode.turns
    assert len(episode.sequences) == 1 and second.start > first.start
    assert episode.prompt_ids(second)[: first.start + 1] == episode.prompt_ids(first) + first.response_ids
