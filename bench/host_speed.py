"""Is the accelerator kept busy during rollouts? Measured on CPU, with a model that costs wall time and no CPU.

The stand-in model computes nothing: every forward call (a prefill or a decode step) keeps its
"device" busy a fixed time, which passes while the decode loop waits for the step's tokens (a sleep:
no core, no GIL), and returns keys/values of one number per token and flat logits. On a GPU that
time is the kernels'; the host's part is everything else. Replies are scripted (a legal action id picked by the request's
seed, then EOS), so every setting plays real games of the env, with its real prompts and opponent.
Per setting, side by side in one run, `wave` (the old barrier) and `continuous` local batching:

- `busy_fraction` = the stand-in's sleeping time / the rollout's wall time;
- `search_cpu_s`: the CPU time the env spent on moves (the MCTS opponent's searches): its worker processes'
  (`worker_cpu_s`, each one's, sorted) and, with workers, the cheap kinds it plays in this process (`env_cpu_here_s`);
- `bound_ratio` = wall time / max(the stand-in's busy time, search_cpu_s / the env's workers): 1.0
  when the rollout takes only as long as its slowest resource, the sum of both under a barrier (each setting
  first plays one untimed rollout on other seeds, as a training run's earlier steps did, from which the env
  costs its episodes by game and seat to place new ones on its workers);
- `host_ms_per_turn`: wall time per model turn with a null model (replies returned at once, env in-process):
  rendering and tokenising prompts, fitting them to the budget, the env's reset and steps; the median of
  HOST_REPEATS rollouts, each after a garbage collection (a leduc_poker rollout of 32 episodes lasts ~0.1 s, where
  one collection of the heap a loaded model leaves would add ~2 ms a turn that a real rollout spreads thin); beside it
  `host_ms_per_turn_whole_prompts`, the same turns with every prompt rendered and tokenised whole (prompts.py's
  memo and windows off, as before they existed); `--whole-prompts` also runs every setting's stand-in that way
  (the setting's `whole_prompts` entry), side by side;
- `ops_per_decode_step`: torch operations dispatched by one decode step of 8 rows (a kernel launch each on a
  GPU), for `generate` with the adapter (the old path), the decode loop with the adapter path, and the decode
  loop with the adapter folded; `ops_per_join`: the same for a row joining a running batch. Beside them
  `folded_budget`, the folded count this model was last measured under (FOLDED_DECODE_OPS_BUDGET), and
  `within_budget`: false flags a change that brought back per-layer LoRA launches, per-row work or per-step mask
  building, or a library version that dispatches more; a person reads why (CI tests only the ratios, which
  no library upgrade moves).

    python -m bench.host_speed                         # SmolLM2-135M's op counts; 32 episodes per setting, 50 ms
    python -m bench.host_speed --small                 # CI size: the tiny model, 8 episodes, 20 ms, no MCTS

On a GPU, `--real-model cuda` replaces the stand-in by the preset's model itself: the same rollouts with the decode
loop as it was (`wave` batching, the adapter unfolded) and as it is (`continuous`, folded), their wall time,
generated tokens/s and nvidia-smi's busy readings (bench/gpu_busy.py):

    python -m bench.host_speed --real-model cuda --json host_speed_gpu.json

`--decode-widths` times one decode step of the preset's model against the running batch's width (the padded
cache's columns), 8 rows each: the median step, and the part of it that appending a column to every layer's
keys and values costs (transformers' cache concatenates, copying the whole cache each step), so growth from
rebuilding the padded cache is seen beside the attention's own growth:

    python -m bench.host_speed --decode-widths 128,512,2048 --real-model cpu
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.gpu_busy import GpuBusy
from ppo_affine.config import GenerationConfig, load_config
from ppo_affine.seeds import derive_seed
from ppo_affine.envs.factory import make_envs
from ppo_affine.envs.tasks import Task, game_task_id
from ppo_affine.generation import Generation
from ppo_affine.local_generation import FoldedAdapter, LocalGenerator, Request
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from ppo_affine.testing.scripted import scripted_reply
from ppo_affine.testing.tiny import load_tiny_policy, make_tiny_model_dir


class ScriptedGenerator(LocalGenerator):
    """The real decode loop, whose sampler plays the scripted replies (the model's logits are ignored), run as on
    an accelerator: steps launch on the event loop and the stand-in's time passes while waiting for the device."""

    def launches_inline(self) -> bool:
        return True

    def _device_values(self, sampled):
        time.sleep(max(0.0, self.policy.model.busy_until - time.monotonic()))
        return sampled.tolist()

    def _choose(self, logits, requests, keys):
        eos = min(self.eos_ids)
        tokens = []
        for request in requests:
            if not request.reply:
                request.script = scripted_reply(self.tokenizer, request.prompt, request.seed, eos)
            tokens.append(request.script[len(request.reply)])
        return torch.tensor(tokens, device=logits.device), torch.zeros(len(tokens), dtype=torch.float64)


class NullGenerator:
    """No model at all: the scripted reply at once, so a rollout's wall time is the host's work (less `seconds`,
    the time spent finding the scripted replies)."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.seconds = 0.0

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        started = time.perf_counter()
        # the seed the local generator gives the request (its run seed 0 mixed in): the same moves as the stand-in
        reply = scripted_reply(self.tokenizer, prompt_ids, derive_seed(0, seed), min(self.eos_ids))
        self.seconds += time.perf_counter() - started
        return Generation(reply)


class StandInModel(torch.nn.Module):
    """A causal LM's interface that computes nothing: each forward call adds `seconds` to the time its device is
    busy (`busy_until`, device calls running one after another), as a GPU's launched kernels would; `calls`
    counts the calls."""

    def __init__(self, seconds: float, vocab: int, eos_id: int, layers: int = 2):
        super().__init__()
        from transformers import GenerationConfig as HFGenerationConfig, LlamaConfig

        self.seconds, self.vocab, self.layers, self.calls = seconds, vocab, layers, 0
        self.busy_until = 0.0
        self.generation_config = HFGenerationConfig(eos_token_id=eos_id)
        self.config = LlamaConfig(vocab_size=vocab, num_hidden_layers=layers)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """One float32 number: the dtype of its keys and values (the decode loop sizes its KV budget by it)."""
        return torch.nn.Embedding(1, 1)

    def forward(self, input_ids, cache=None, past_key_values=None, **ignored):
        from transformers import DynamicCache

        self.calls += 1
        self.busy_until = max(self.busy_until, time.monotonic()) + self.seconds
        rows, width = input_ids.shape
        new = torch.zeros((rows, 1, width, 1))
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = DynamicCache(ddp_cache_data=[(new, new)] * self.layers)
        else:
            for layer in range(self.layers):
                cache.update(new, new, layer)
        logits = torch.zeros((rows, 1, self.vocab))
        return SimpleNamespace(logits=logits, cache=cache, past_key_values=cache)


class StandInPolicy:
    """What the local generator uses of a Policy, around the stand-in model."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer = tokenizer
        self.model = StandInModel(seconds, len(tokenizer), tokenizer.eos_token_id)
        self.device = torch.device("cpu")

    @contextlib.contextmanager
    def evaluating(self):
        yield


# ---------------------------------------------------------------------- rollouts
def tasks_for(games: list[str], opponent: str, episodes: int, first_seed: int = 5000) -> list[Task]:
    return [Task("openspiel", game_task_id(games[i % len(games)], 0), first_seed + i, opponent, "bench", False)
            for i in range(episodes)]


def children_cpu_seconds() -> dict[int, float]:
    """CPU seconds of each process this one started (the env's workers; not multiprocessing's resource tracker),
    by pid."""
    seconds = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
            times = child.cpu_times()
            seconds[child.pid] = times.user + times.system
        except psutil.Error:
            pass
    return seconds


def env_cpu_seconds_here(runner: RolloutRunner) -> float:
    """The CPU seconds the game env spent on moves in this process (with workers, the cheap kinds play here)."""
    return sum(getattr(env, "cpu_seconds_here", 0.0) for _, env in runner.envs.values())


async def timed_rollout(runner: RolloutRunner, tasks: list[Task]) -> dict:
    cpu, here = children_cpu_seconds(), env_cpu_seconds_here(runner)
    started = time.perf_counter()
    episodes = await runner.run(tasks, step=0)
    wall = time.perf_counter() - started
    spent = sorted(round(seconds - cpu.get(pid, 0.0), 2) for pid, seconds in children_cpu_seconds().items())
    here = env_cpu_seconds_here(runner) - here
    return {"wall_s": wall, "search_cpu_s": sum(spent) + here, "worker_cpu_s": spent, "env_cpu_here_s": here,
            "turns": sum(len(e.turns) for e in episodes), "errors": sum(bool(e.error) for e in episodes),
            "generated_tokens": sum(e.generated_tokens for e in episodes)}


async def play_setting(policy, games: list[str], opponent: str, episodes: int, cost: float,
                       env_spec_overrides: list[str], incremental_prompts: bool = True) -> dict:
    """The setting's rollout with the null model, then with the stand-in under each local batching."""
    config = load_config(overrides=["env.envs.openspiel.workers=auto", *env_spec_overrides])
    envs = make_envs(config.env, seed=0, meets_search=opponent == "mcts")
    workers = max(1, len(getattr(envs["openspiel"][1], "_workers", [])))
    builder = PromptBuilder(policy.tokenizer, GenerationConfig().max_prompt_tokens, incremental=incremental_prompts)
    result: dict = {"games": games, "opponent": opponent, "episodes": episodes, "env_workers": workers}
    try:
        null_cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes)
        null = RolloutRunner(envs, NullGenerator(policy.tokenizer, {policy.tokenizer.eos_token_id}), builder, null_cfg)
        await null.run(tasks_for(games, "random", workers), step=0)  # starts the env's worker processes
        # a training step's rollout follows others: the env has costed each game and seat's episodes (which
        # worker takes a new one), so one untimed rollout on seeds of its own comes first
        await null.run(tasks_for(games, opponent, episodes, first_seed=6000), step=0)
        result["null_model"] = await timed_rollout(null, tasks_for(games, opponent, episodes))
        for batching in ("wave", "continuous"):
            cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes, max_new_tokens=8,
                                   local_batching=batching)
            generator = ScriptedGenerator(policy, cfg, seed=0)
            before = policy.model.calls
            timed = await timed_rollout(RolloutRunner(envs, generator, builder, cfg), tasks_for(games, opponent,
                                                                                              episodes))
            await generator.close()
            calls = policy.model.calls - before
            busy = calls * cost
            bound = max(busy, timed["search_cpu_s"] / workers)
            result[batching] = timed | {"busy_s": busy, "busy_fraction": busy / timed["wall_s"],
                                        "bound_ratio": timed["wall_s"] / bound, "forward_calls": calls}
        result["continuous_over_wave"] = result["continuous"]["wall_s"] / result["wave"]["wall_s"]
    finally:
        for _, env in envs.values():
            await env.close()
    return result


# The decode loop as it was (a barrier per wave, the adapter's own matmuls) and as it is.
REAL_MODES = {"before": {"local_batching": "wave", "fold_adapter": False},
              "after": {"local_batching": "continuous", "fold_adapter": True}}


async def play_real(policy, games: list[str], opponent: str, episodes: int, max_new_tokens: int) -> dict:
    """The setting's rollout with the real model generating, the decode loop before and after, with nvidia-smi's
    busy readings on a GPU."""
    config = load_config(overrides=["env.envs.openspiel.workers=auto"])
    envs = make_envs(config.env, seed=0, meets_search=opponent == "mcts")
    builder = PromptBuilder(policy.tokenizer, GenerationConfig().max_prompt_tokens)
    result: dict = {"games": games, "opponent": opponent, "episodes": episodes, "max_new_tokens": max_new_tokens}
    try:
        for label in ("warm-up", *REAL_MODES):
            cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes, max_new_tokens=max_new_tokens,
                                   temperature=1.0, **REAL_MODES.get(label, REAL_MODES["after"]))
            generator = LocalGenerator(policy, cfg, seed=0)
            tasks = tasks_for(games, opponent, episodes if label != "warm-up" else 4)
            with GpuBusy() as busy:
                timed = await timed_rollout(RolloutRunner(envs, generator, builder, cfg), tasks)
            await generator.close()
            if label != "warm-up":
                result[label] = timed | {"tokens_per_s": timed["generated_tokens"] / timed["wall_s"],
                                         "forward_calls": generator.forward_calls, "gpu_busy": busy.summary()}
        result["after_over_before"] = result["after"]["wall_s"] / result["before"]["wall_s"]
    finally:
        for _, env in envs.values():
            await env.close()
    return result


HOST_REPEATS = 3


def host_ms_per_turn(tokenizer, game: str, episodes: int, incremental_prompts: bool = True) -> float:
    """Wall milliseconds per turn with the null model, env in-process, at the default prompt budget: the median
    of HOST_REPEATS rollouts, each on seeds of its own."""
    import gc
    import statistics

    config = load_config(overrides=["env.envs.openspiel.workers=0"])
    envs = make_envs(config.env, seed=0, meets_search=False)
    cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes, context_strategy="full")
    null = NullGenerator(tokenizer, {tokenizer.eos_token_id})
    builder = PromptBuilder(tokenizer, cfg.max_prompt_tokens, incremental=incremental_prompts)
    runner = RolloutRunner(envs, null, builder, cfg)

    async def play() -> float:
        try:
            await runner.run(tasks_for([game], "random", 4, first_seed=4000), step=0)  # imports, first-use costs
            per_turn = []
            for repeat in range(HOST_REPEATS):  # seeds of its own each: a step's episodes are new ones
                gc.collect()
                null.seconds = 0.0
                timed = await timed_rollout(runner, tasks_for([game], "random", episodes, 5000 + repeat * episodes))
                per_turn.append(1000 * (timed["wall_s"] - null.seconds) / max(1, timed["turns"]))
            return statistics.median(per_turn)
        finally:
            await envs["openspiel"][1].close()
    return asyncio.run(play())


# ---------------------------------------------------------------------- operations per decode step
class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched in its thread while active (each is a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class CountingGenerator(LocalGenerator):
    """The decode loop with the operations of each forward step counted: a plain decode step, or one where
    rows join a running batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_ops: list[int] = []
        self.join_ops: list[int] = []

    def _compute_step(self, joining):
        running_before = self._running is not None
        with OpCounter() as counter:
            values = super()._compute_step(joining)
        if not joining:
            self.step_ops.append(counter.count)
        elif running_before:
            self.join_ops.append(counter.count)
        return values


# The folded decode step's operations each counted model stays under (a tenth above the count when measured: tiny
# 202 with torch 2.13 / transformers 5.24, where the adapter path took 342, generate 385, and 232 before the
# decode step handed the attention its additive mask; SmolLM2-135M 2 246, docs/benchmarks.md).
FOLDED_DECODE_OPS_BUDGET = {"tiny": 222, "HuggingFaceTB/SmolLM2-135M-Instruct": 2300}


def ops_per_decode_step(policy, rows: int = 8, tokens: int = 8) -> dict:
    builder = PromptBuilder(policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "Legal Actions:\n0 -> a\n" * (1 + i)}]) for i in range(rows)]
    result = {}
    for label, fold in (("decode_loop_adapter_path", False), ("decode_loop_folded", True)):
        cfg = GenerationConfig(backend="local", max_new_tokens=tokens, temperature=1.0, fold_adapter=fold)
        generator = CountingGenerator(policy, cfg, seed=0)
        eos = generator.eos_ids
        generator.eos_ids = set()  # every row runs to max_new_tokens

        async def ask():
            async with generator.rollout(step=0):
                first = asyncio.ensure_future(generator.generate(prompts[0], 0, 1))
                while generator.forward_calls < 2:  # the first row decodes alone: the others then join it
                    await asyncio.sleep(0.001)
                rest = [generator.generate(p, i + 1, i + 2) for i, p in enumerate(prompts[1:])]
                await asyncio.gather(first, *rest)
            await generator.close()
        asyncio.run(ask())
        generator.eos_ids = eos
        result[label] = sorted(generator.step_ops)[len(generator.step_ops) // 2]
        # a step where rows join a running batch: its decode step, the joining rows' prefill, the merge
        result[f"{label}_join_extra"] = max(generator.join_ops, default=result[label]) - result[label]
    result["generate_adapter_path"] = generate_ops_per_token(policy, prompts, tokens)
    return result


def generate_ops_per_token(policy, prompts: list[list[int]], tokens: int) -> int:
    """`generate`'s operations per decode step with the adapter on: (ops for `tokens` - ops for 1) / (tokens - 1)."""
    width = max(map(len, prompts))
    pad = policy.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()

    def count(new_tokens: int) -> int:
        with torch.no_grad(), OpCounter() as counter:
            policy.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=True, top_k=None, pad_token_id=pad)
        return counter.count
    policy.eval()
    return round((count(tokens) - count(1)) / (tokens - 1))


def decode_ms_by_width(policy, widths: list[int], rows: int = 8, steps: int = 12) -> dict[str, dict[str, float]]:
    """Per width: the median decode step of `rows` rows whose prompts fill `width` columns (ms), and the median
    time of appending one column to every layer's keys and values by concatenation, as the cache does (ms)."""
    cfg = GenerationConfig(backend="local", max_new_tokens=steps + 2, temperature=1.0, reuse_kv_cache=False)
    filler = policy.tokenizer("go ", add_special_tokens=False)["input_ids"]
    device = policy.device
    result = {}
    for width in widths:
        generator = LocalGenerator(policy, cfg, seed=0)
        prompt = (filler * width)[:width]
        requests = [Request(row, prompt, seed=row, future=None) for row in range(rows)]
        with contextlib.ExitStack() as held, torch.no_grad():
            held.enter_context(policy.evaluating())
            if generator.folds_adapter():
                held.enter_context(FoldedAdapter(policy.model))
            generator._device_values(generator._launch_step(requests))  # the prefill: the batch starts running
            step_ms, append_ms = [], []
            for _ in range(steps):
                started = time.perf_counter()
                generator._device_values(generator._launch_step([]))
                step_ms.append(1000 * (time.perf_counter() - started))
                layers = generator._running.cache.layers
                started = time.perf_counter()
                appended = [torch.cat([tensor, tensor[:, :, -1:]], dim=2) for layer in layers
                            for tensor in (layer.keys, layer.values)]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                append_ms.append(1000 * (time.perf_counter() - started))
                del appended
        result[str(width)] = {"ms_per_step": round(sorted(step_ms)[steps // 2], 3),
                              "cache_append_ms": round(sorted(append_ms)[steps // 2], 3)}
        print(width, json.dumps(result[str(width)]), flush=True)
    return result


# ---------------------------------------------------------------------- the run
def real_policy(preset: str, device: str = "cpu", overrides: list[str] = ()):
    from ppo_affine.policy import load_policy

    config = load_config(presets=[preset], overrides=list(overrides))
    torch.manual_seed(0)
    return load_policy(config.train.model, config.train.lora, torch.device(device)), config.train.model.name_or_path


def real_model_main(args) -> dict:
    """`--real-model DEVICE`: no stand-in; the preset's model generates on DEVICE, before and after."""
    policy, name = real_policy(args.preset, args.real_model, args.set)
    settings = {"leduc_poker/random": (["leduc_poker"], "random"), "goofspiel/random": (["goofspiel"], "random"),
                "validator/mcts": (["leduc_poker", "liars_dice", "goofspiel"], "mcts")}
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"model": name, "device": args.real_model, "settings": {}}
    for setting, (games, opponent) in settings.items():
        if setting not in skip:
            result["settings"][setting] = asyncio.run(play_real(policy, games, opponent, args.episodes or 32,
                                                                args.max_new_tokens))
            print(setting, json.dumps(result["settings"][setting]), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="CI size: tiny model, 8 episodes, 20 ms, vs random only")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--cost-ms", type=float, default=None, help="the stand-in's wall time per forward call")
    parser.add_argument("--preset", default="cpu", help="the real model whose operations are counted")
    parser.add_argument("--skip", default="", help="comma-separated settings to leave out")
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    parser.add_argument("--whole-prompts", action="store_true",
                        help="also run every setting's stand-in with each prompt rendered and tokenised whole")
    parser.add_argument("--real-model", metavar="DEVICE",
                        help="no stand-in: the preset's model generates on DEVICE (e.g. cuda), decode loop before and "
                             "after, with nvidia-smi's busy readings")
    parser.add_argument("--max-new-tokens", type=int, default=6, help="with --real-model")
    parser.add_argument("--set", action="append", default=[], help="with --real-model: config overrides")
    parser.add_argument("--decode-widths", metavar="W,W,...",
                        help="only time a decode step of 8 rows at these running-batch widths, on --real-model's "
                             "device (default cpu), the preset's model (--small: the tiny model)")
    args = parser.parse_args(argv)
    if args.decode_widths:
        widths = [int(width) for width in args.decode_widths.split(",")]
        if args.small:
            policy, name = load_tiny_policy(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="host-speed-")) / "t")), "tiny"
        else:
            policy, name = real_policy(args.preset, args.real_model or "cpu", args.set)
        result = {"model": name, "device": str(policy.device), "rows": 8,
                  "decode_ms_by_width": decode_ms_by_width(policy, widths)}
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return result
    if args.real_model:
        result = real_model_main(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return result
    episodes = args.episodes or (8 if args.small else 32)
    cost = (args.cost_ms or (20.0 if args.small else 50.0)) / 1000
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="host-speed-")) / "tiny")
    counted, counted_name = (load_tiny_policy(model_dir), "tiny") if args.small else real_policy(args.preset)
    stand_in = StandInPolicy(counted.tokenizer, cost)
    settings = {
        "leduc_poker/random": (["leduc_poker"], "random"),
        "goofspiel/random": (["goofspiel"], "random"),
        "othello/random": (["othello"], "random"),
        "validator/mcts": (["leduc_poker", "liars_dice", "goofspiel"], "mcts"),
    }
    if args.small:
        settings.pop("validator/mcts")
    result: dict = {"stand_in_ms": cost * 1000, "episodes": episodes, "settings": {}, "host_ms_per_turn": {},
                    "host_ms_per_turn_whole_prompts": {}}
    # The stand-in's tensors are a few numbers per token: with one thread no OpenMP team spin-waits for cores
    # that other processes hold (on a GPU's host these tensors live on the device).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name, (games, opponent) in settings.items():
        if name not in skip:
            result["settings"][name] = asyncio.run(play_setting(stand_in, games, opponent, episodes, cost, []))
            if args.whole_prompts:
                result["settings"][name]["whole_prompts"] = asyncio.run(
                    play_setting(stand_in, games, opponent, episodes, cost, [], incremental_prompts=False))
    torch.set_num_threads(threads)
    for game in ("leduc_poker", "goofspiel", "othello"):
        for incremental, key in ((False, "host_ms_per_turn_whole_prompts"), (True, "host_ms_per_turn")):
            result[key][game] = host_ms_per_turn(counted.tokenizer, game, episodes, incremental)
    ops = {"model": counted_name, **ops_per_decode_step(counted)}
    budget = FOLDED_DECODE_OPS_BUDGET.get(counted_name)
    ops["folded_budget"] = budget
    ops["within_budget"] = None if budget is None else ops["decode_loop_folded"] <= budget
    if ops["within_budget"] is False:
        print(f"warning: a folded decode step of {counted_name} dispatched {ops['decode_loop_folded']} operations, "
              f"above its budget of {budget}", flush=True)
    result["ops_per_decode_step"] = ops
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return result


if __name__ == "__main__":
    main()
