"""decode_caches.py and the decode loop's memory caps: the budget halved by running out of memory grows back."""
import asyncio

from ppo_affine.config import GenerationConfig
from ppo_affine.decode_caches import DecodeCaches
from ppo_affine.prompts import PromptBuilder
from test_generation import RunsOutOfMemoryAbove


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
