"""decode_caches.py and what the decode loop asks of memory: caps halved by running out of memory grow back; a
prefill runs in chunks of `generation.prefill_chunk_tokens`."""
import asyncio
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ppo_affine.config import GenerationConfig, LoraConfig, ModelConfig
from ppo_affine.decode_caches import DecodeCaches
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.policy import load_policy
from ppo_affine.prompts import PromptBuilder
from ppo_affine.testing.agent_episode import (CHAT_TEMPLATE, ScriptedReasoning, converse, observation,
                                              reasoning_stripped)
from ppo_affine.testing.tiny import make_tiny_architecture_dir
from test_generation import RunsOutOfMemoryAbove, played_with, replies


def test_a_halved_budget_doubles_back_to_where_it_was_and_no_further():
    caches = DecodeCaches(budget=1000, bytes_per_token=256, row_bytes=0, reuse=True)
    caches.halve_budget(held=300)
    assert caches.budget_tokens == 150 and caches.full_budget == 1000
    grown = []
    for _ in range(4):
        caches.grow_budget_back()
        grown.append(caches.budget_tokens)
    assert grown == [300, 600, 1000, 1000] and caches.full_budget is None


def test_running_out_of_memory_twice_halves_from_the_budget_before_and_remembers_the_first():
    caches = DecodeCaches(budget=1000, bytes_per_token=256, row_bytes=0, reuse=True)
    caches.halve_budget(held=800)  # 400
    caches.halve_budget(held=200)  # 100
    assert caches.budget_tokens == 100 and caches.full_budget == 1000


class RunsOutOfMemoryOnce(RunsOutOfMemoryAbove):
    """The first forward call of more than `rows` rows runs out of memory (the memory an update held is then freed);
    every step's caps are noted after the loop considered growing them back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.caps: list[tuple[int | None, int]] = []

    def _forward(self, input_ids, *args):
        try:
            return super()._forward(input_ids, *args)
        except Exception:
            self.rows = 10**6
            raise

    def _grow_caps_back(self):
        super()._grow_caps_back()
        self.caps.append((self.row_cap, self.cache_budget))


def test_the_row_cap_and_budget_halved_by_running_out_of_memory_grow_back_after_k_clean_steps(tiny_policy):
    """Prompts of 15 and 19 tokens decode; at their second token prompts of 23 and 27 join (their prefill fits: 2
    rows), and the 4-row decode step after it runs out of memory holding 4 rows x 27 columns (the widest prompt) =
    108 tokens: the budget of 1000 drops to 54 and at most 2 rows run. Every 3 steps without running out of memory
    the cap doubles (2 -> 4, the rows it ran out with: lifted) and the budget doubles, 54 -> 108 -> ... -> 1000."""
    cfg = GenerationConfig(backend="local", max_new_tokens=12, temperature=1.0, reuse_kv_cache=False,
                           kv_cache_budget=1000, caps_grow_back_steps=3)
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (1, 3, 5, 7)]
    generator = RunsOutOfMemoryOnce(tiny_policy, cfg, seed=0, rows=2, later=prompts[2:])
    generator.eos_ids = set()

    async def ask():
        async with generator.rollout(step=0):
            first = await asyncio.gather(*(generator.generate(p, order_key=i, seed=10 + i)
                                           for i, p in enumerate(prompts[:2])))
            later = await asyncio.gather(*generator.asked)
        return [g.token_ids for g in first + later]
    squeezed = asyncio.run(ask())
    assert generator.out_of_memory_retries == 1 and all(len(reply) == 12 for reply in squeezed)
    assert generator.caps[:3] == [(None, 1000)] * 3  # prefill, decode, decode + the joiners' prefill
    after = generator.caps[3:]
    assert after[:15] == ([(2, 54)] * 2 + [(None, 108)] + [(None, 108)] * 2 + [(None, 216)] + [(None, 216)] * 2
                          + [(None, 432)] + [(None, 432)] * 2 + [(None, 864)] + [(None, 864)] * 2 + [(None, 1000)])
    assert set(after[15:]) == {(None, 1000)}  # grown back to where it was, and no further


# ---------------------------------------------------------------------- chunked prefill
class LogitsAndCalls(LocalGenerator):
    """The real decode loop, keeping every sampled row's logits and the shape of every forward call's input."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []
        self.calls: list[tuple[int, int]] = []  # (rows, columns fed)

    def _forward(self, input_ids, *args):
        self.calls.append(tuple(input_ids.shape))
        return super()._forward(input_ids, *args)

    def _choose(self, logits, requests, keys):
        self.logits.append(logits.detach().clone())
        return super()._choose(logits, requests, keys)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return make_tiny_architecture_dir(tmp_path_factory.mktemp("hybrid"), "qwen3_5_moe_text")


def policy_from(folder: Path):
    torch.manual_seed(0)
    model = ModelConfig(name_or_path=str(folder), use_4bit=False, dtype="float32", gradient_checkpointing=False)
    return load_policy(model, LoraConfig(), torch.device("cpu"))


@pytest.mark.parametrize("model", ["qwen3", "qwen3_5_moe"])
def test_a_prefill_in_chunks_of_7_tokens_gives_the_replies_and_logits_of_one_call(tiny_policy, hybrid_dir, model):
    """5 episodes of 3 turns, 3 at once, prompts of ~30 to ~90 tokens: kept caches, joins mid-batch and (qwen3)
    shared first prompts, every prefill cut into calls of at most 7 columns, each continuing the last one's cache
    (keys/values, or a linear-attention layer's convolution window and recurrent state over left padding)."""
    policy = tiny_policy if model == "qwen3" else policy_from(hybrid_dir)
    runs = {chunk: played_with(policy, LogitsAndCalls, prefill_chunk_tokens=chunk) for chunk in (4096, 7)}
    (whole_replies, whole), (chunked_replies, chunked) = runs[4096], runs[7]
    assert chunked_replies == whole_replies
    assert max(columns for _, columns in whole.calls) > 7 and max(columns for _, columns in chunked.calls) == 7
    assert chunked.prefilled_tokens == whole.prefilled_tokens and chunked.forward_calls > whole.forward_calls
    assert len(chunked.logits) == len(whole.logits)
    # float32 noise: keys/values are the same numbers either way (measured ~1e-6); the chunked delta rule sums a
    # recurrent state in blocks of 64 tokens that start elsewhere when the call is cut elsewhere (measured 6e-5 on
    # logits up to ~8, the size tests/test_architectures.py sees for other lengths; a leak moves them by ~1)
    tolerance = 1e-5 if model == "qwen3" else 2e-4
    for cut, one_call in zip(chunked.logits, whole.logits):
        assert torch.allclose(cut, one_call, atol=tolerance, rtol=0)


class LargestTensors(LocalGenerator):
    """The real decode loop; each forward call records (rows, query columns, key columns: the 2D mask's width), the
    most elements of any tensor made inside the model and the longest query any attention call computed scores for.
    The mode is entered in the call's own thread (a CPU step runs in a thread; modes are per thread)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[dict] = []

    def _forward(self, input_ids, mask, *args):
        with LargestTensorMode() as seen:
            out = super()._forward(input_ids, mask, *args)
        self.calls.append({"rows": input_ids.shape[0], "queries": input_ids.shape[1], "keys": mask.shape[1],
                           "largest": seen.largest, "longest_query": seen.longest_query})
        return out


class LargestTensorMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.largest, self.longest_query = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:  # its scores: [rows, heads, queries, keys]
            self.longest_query = max(self.longest_query, args[0].shape[-2])
        if isinstance(result, torch.Tensor):
            self.largest = max(self.largest, result.numel())
        return result


def prefill_of(policy, chunk: int, lengths: tuple[int, ...]) -> LargestTensors:
    cfg = GenerationConfig(backend="local", max_new_tokens=1, temperature=0.0, reuse_kv_cache=False,
                           prefill_chunk_tokens=chunk, local_batching="wave")
    generator = LargestTensors(policy, cfg, seed=0)
    prompts = [[(7 * i + row) % 500 + 20 for i in range(n)] for row, n in enumerate(lengths)]
    replies(generator, prompts)
    return generator


@pytest.mark.slow
def test_a_16k_token_prefill_builds_no_mask_or_scores_larger_than_rows_x_chunk_x_context(tiny_policy):
    """Two prompts of 16 384 and 1 000 tokens join together (the shorter row left-padded: a real 2D mask): 4 calls
    of 4 096 columns, in each no tensor is larger than rows x 4 096 x the columns so far, no attention scores
    more than 4 096 queries."""
    generator = prefill_of(tiny_policy, 4096, (16384, 1000))
    assert [(c["rows"], c["queries"], c["keys"]) for c in generator.calls] == [
        (2, 4096, 4096), (2, 4096, 8192), (2, 4096, 12288), (2, 4096, 16384)]
    for call in generator.calls:
        assert call["largest"] <= call["rows"] * 4096 * call["keys"] and call["longest_query"] <= 4096


def test_the_largest_tensor_hook_sees_the_square_mask_of_an_unchunked_prefill(tiny_policy):
    """The hook's control: 6 000 and 1 000 tokens in one call build a [2, 1, 6000, 6000] mask (72 M elements, more
    than 2 x 4 096 x 6 000 = 49 M) and scores for 6 000 queries at once."""
    generator = prefill_of(tiny_policy, 8192, (6000, 1000))
    call = generator.calls[0]
    assert (call["rows"], call["queries"], call["keys"]) == (2, 6000, 6000)
    assert call["largest"] >= 2 * 6000 * 6000 > 2 * 4096 * 6000 and call["longest_query"] == 6000


# ---------------------------------------------------------------------- a turn continues from the last one's state
TEMPLATE = CHAT_TEMPLATE  # a small one dropping earlier reasoning as Qwen3's does, until Qwen3.6's fixture lands
TINY_DIRS = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe_text"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("continuation")
    return {name: make_tiny_architecture_dir(root / name, kind) for name, kind in TINY_DIRS.items()}


def templated_policy(folder: Path):
    policy = policy_from(folder)
    policy.tokenizer.chat_template = TEMPLATE
    return policy


@pytest.mark.parametrize("model", list(TINY_DIRS))
def test_turns_continued_from_kept_caches_give_the_replies_and_logprobs_of_prefilling_each_prompt_whole(
        tiny_dirs, model):
    """6 greedy turns of a templated agent episode, each reply resent as the assistant's content (the template cuts
    what precedes a `</think>`), so a turn continues from the last turn's end where the history comes back as it
    was sampled, else from its last message boundary (linear attention) or the longest common prefix (keys and
    values): every token and log-prob equal to prefilling every prompt whole, in float32 on CPU to 1e-5."""
    policy = templated_policy(tiny_dirs[model])
    runs = {}
    for reuse in (True, False):
        cfg = GenerationConfig(backend="local", max_new_tokens=8, temperature=0.0, reuse_kv_cache=reuse)
        generator = LocalGenerator(policy, cfg, seed=0)
        runs[reuse] = converse(generator, 6, lambda turn, text: {"role": "assistant", "content": text}), generator
    (kept_replies, kept_logprobs, final), kept = runs[True]
    (whole_replies, whole_logprobs, _), whole = runs[False]
    assert kept_replies == whole_replies
    # keys/values: 1e-5. A linear-attention state continued over the new tokens sums its blocks of 64 tokens from
    # elsewhere than one call over the whole prompt: measured 1.2e-5 here, where two whole prefills cut at other
    # columns (chunks of 7 and of 4096, both exact) differ by 7e-6; transformers runs the delta rule, its gated norm
    # and the rotary angles in float32 even in a float64 model, so no float64 run can narrow it
    tolerance = 3e-5 if model == "qwen3_5_moe" else 1e-5
    for continued, prefilled in zip(kept_logprobs, whole_logprobs):
        assert torch.allclose(torch.tensor(continued), torch.tensor(prefilled), atol=tolerance, rtol=0)
    assert whole.prefilled_tokens == whole.prompt_tokens
    assert kept.prefilled_tokens < 0.5 * kept.prompt_tokens


@pytest.mark.slow
def test_a_30_turn_agent_episode_without_its_replies_reasoning_prefills_little_more_than_its_final_length(tiny_dirs):
    """Qwen3.6's layer kinds (tiny), reasoning on, the history resent without each reply's reasoning, observations
    as tool and as user messages: every turn continues from the state kept at its last prompt's message boundary,
    so the episode prefills at most 1.2 x its final length (re-prefilling every turn: the sum of its prompts), and
    no turn's prefix broke."""
    policy = templated_policy(tiny_dirs["qwen3_5_moe"])
    cfg = GenerationConfig(backend="local", max_new_tokens=64, temperature=1.0)
    generator = ScriptedReasoning(policy, cfg, seed=0)
    _, _, final = converse(generator, 30, reasoning_stripped)
    metrics = generator.memory_metrics()
    assert generator.caches.continued == 29 and metrics["perf/prefix_break_rate"] == 0.0
    assert metrics["perf/prefill_tokens"] == generator.prefilled_tokens <= 1.2 * final
    assert generator.prompt_tokens > 10 * final  # what prefilling every prompt whole would cost


def test_a_history_changed_before_the_boundary_breaks_the_prefix_and_is_prefilled_whole(tiny_dirs):
    """A kept state continues only from exactly the tokens it folded in: an agent that rewrites its first message
    (a summary of the history) breaks the prefix, and that turn is prefilled whole."""
    policy = templated_policy(tiny_dirs["qwen3_5_moe"])
    rates = []
    for rewrite in (False, True):
        generator = ScriptedReasoning(policy, GenerationConfig(backend="local", max_new_tokens=64), seed=0)
        builder = PromptBuilder(generator.tokenizer, 10**6)
        first = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix play()."}]
        prompts = [builder.encode(first),
                   builder.encode(first + [{"role": "assistant", "content": "I look."}, observation(1)])]
        if rewrite:
            prompts[1] = builder.encode([{"role": "system", "content": "You fix bugs (summary)."},
                                         *first[1:], {"role": "assistant", "content": "I look."}, observation(1)])

        async def two_turns():
            async with generator.rollout(step=0):
                for turn, prompt in enumerate(prompts):
                    await generator.generate(prompt, order_key=0, seed=turn)
        asyncio.run(two_turns())
        rates.append((generator.memory_metrics()["perf/prefix_break_rate"], generator.prefilled_tokens,
                      len(prompts[0]) + len(prompts[1])))
    (kept_rate, kept_prefilled, _), (broken_rate, broken_prefilled, both_prompts) = rates
    assert kept_rate == 0.0 and kept_prefilled < both_prompts
    assert broken_rate == 1.0 and broken_prefilled == both_prompts
