"""The Affine trace env, in-process: predict the exact stdout of a program with injected debug prints.

Faithful to docs/protocols.md, 'The trace env': program cleaning ('Cleaning the program'), the
`__DBG_N__` injector seeded by the task id ('Print injection'), ground truth = stripped stdout, partial
on a crash and "" on a timeout ('Ground truth'), the prompt's structure ('The trace prompt'), answer
cleaning and whitespace/case-blind comparison ('Cleaning and comparing the answer') and the
single-turn reset/step/state/stop protocol ('The trace reset/step protocol'), including its report
that reveals the answer and the 1.0 an empty answer earns when the expected output is empty.

Departures: programs run in ppo_affine/envs/sandbox.py (rlimits, bubblewrap) instead of bare `subprocess.run`,
off the event loop, with a fixed hash seed; a run killed for flooding stdout or for CPU time counts
as a timeout (ground truth ""), one that passes the memory limit crashes with MemoryError where the
real env has no limit; a sandbox that fails to start is an error, never a ground truth; the step
report shows the cleaned answer (what was compared).
Tasks come from the embedded generator (ppo_affine/envs/trace_programs.py) by default, or from the real
dataset with `source="hf"`. `skip_degenerate=True` swaps tasks whose expected output is empty or
whose program crashes or times out for the next task id, for training.
"""
from __future__ import annotations

import ast
import asyncio
import operator
import random
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ppo_affine.envs.base import StepResult, step_result
from ppo_affine.envs.sandbox import RunResult, SandboxLimits, require_isolation, run_python_async
from ppo_affine.envs.tasks import TRACE_HELD_OUT, TRACE_LEVEL_STRIDE, TRACE_LEVELS, is_held_out_trace_task
from ppo_affine.envs.trace_programs import generate_program, repeats_a_held_out_program

SOURCES = ("embedded", "hf")
MAX_INJECTIONS = 6
ASSIGN_INJECT_PROBABILITY = 0.6
IF_INJECT_PROBABILITY = 0.4
REPORT_CHARS = 500
HF_TASK_ID_SPACE = 10**6  # a missing task id: like the real env, for the dataset source
EMBEDDED_TASK_ID_SPACE = TRACE_LEVEL_STRIDE * len(TRACE_LEVELS)  # all embedded difficulty levels
SEED_SPACE = 2**32
CACHE_SIZE = 10_000
MAX_DEGENERATE_SKIPS = 16
FINISHED_KEPT = 4096  # finished episodes that state/step can still report before stop()


# ---------------------------------------------------------------- the task: cleaning and injection
def clean_program_source(source: str) -> str:
    """Strip a surrounding ``` fence (language tag included) and whitespace, as the real env does
    (docs/protocols.md, 'Cleaning the program')."""
    text = source.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.strip()
    if text.endswith("```"):
        text = text[:-3].strip()
    return text


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _target_names(element)]
    return []  # attributes, subscripts and starred targets are never recorded


class _DebugPrintInjector(ast.NodeTransformer):
    """Adds up to six `print('__DBG_n__', ...)` calls after assignments and ifs (docs/protocols.md, 'Print injection').

    Only the module body and the bodies of `for`, `if` and `def` go through `_process_body`;
    every other statement (while, try, with, class, async def) is walked generically, so the ifs,
    fors and defs nested in it are still processed but its own direct statements are not.
    """

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.injections_done = 0
        self.scopes: list[list[str]] = [[]]

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = self._process_body(node.body)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        self.scopes.append([arg.arg for arg in node.args.args])
        node.body = self._process_body(node.body)
        self.scopes.pop()
        return node

    def visit_For(self, node: ast.For) -> ast.For:
        node.body = self._process_body(node.body)
        node.orelse = self._process_body(node.orelse)
        return node

    def visit_If(self, node: ast.If) -> ast.If:
        node.body = self._process_body(node.body)
        node.orelse = self._process_body(node.orelse)
        return node

    def _process_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        processed: list[ast.stmt] = []
        for statement in body:
            self._record_targets(statement)
            processed.append(self.visit(statement))
            if self.injections_done >= MAX_INJECTIONS:
                continue
            if isinstance(statement, (ast.Assign, ast.AugAssign)):
                probability = ASSIGN_INJECT_PROBABILITY
            elif isinstance(statement, ast.If):
                probability = IF_INJECT_PROBABILITY
            else:
                continue
            # The draw happens even when no variable is live yet: it keeps the RNG stream in step.
            if self.rng.random() < probability:
                live = self._live_names()
                if live:
                    processed.append(self._debug_print(live))
                    self.injections_done += 1
        return processed

    def _record_targets(self, statement: ast.stmt) -> None:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, (ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [statement.target]
        else:
            return
        scope = self.scopes[-1]
        for target in targets:
            for name in _target_names(target):
                if name not in scope:
                    scope.append(name)

    def _live_names(self) -> list[str]:
        live: list[str] = []
        for scope in self.scopes:
            live.extend(name for name in scope if name not in live)
        return live

    def _debug_print(self, live: list[str]) -> ast.stmt:
        count = self.rng.randint(1, min(3, len(live)))
        chosen = self.rng.sample(live, count)
        args: list[ast.expr] = [ast.Constant(f"__DBG_{self.injections_done}__")]
        for name in chosen:
            shown = (f"repr({name}) if isinstance({name}, (int, float, str, bool, type(None))) "
                     f"else type({name}).__name__")
            args.append(ast.parse(shown, mode="eval").body)
        return ast.Expr(ast.Call(func=ast.Name("print", ast.Load()), args=args, keywords=[]))


def inject_debug_prints(source: str, seed: int) -> tuple[str, bool]:
    """(program text the model sees, parsed): the cleaned source with debug prints injected, or on a
    syntax error the real env's comment line followed by the cleaned source."""
    cleaned = clean_program_source(source)
    try:
        tree = ast.parse(cleaned)
    except (SyntaxError, ValueError) as exc:  # 3.11 raises ValueError for NUL bytes, 3.12 SyntaxError
        return f"# Syntax Error in source: {exc}\n{cleaned}", False
    tree = _DebugPrintInjector(seed).visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree)), True


def build_prompt(program: str, inputs: str) -> str:
    """The single user message (docs/protocols.md, 'The trace prompt'); our wording, the real env's structure."""
    return (
        "Predict the exact and complete standard output (stdout) of the Python program below, "
        "including the output of every print statement.\n\n"
        "Debug prints that start with '__DBG_' have been injected into the program; include their output "
        "exactly as it would appear, together with everything else the program prints.\n\n"
        f"Program:\n```python\n{program}\n```\n\n"
        f"Input (stdin):\n```\n{inputs}\n```\n\n"
        "Reply with the full stdout content only, with no explanation or commentary outside the predicted output."
    )


# ---------------------------------------------------------------- the answer: cleaning and scoring
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_THINKING_BLOCK = re.compile(r"<thinking>.*?</thinking>", re.DOTALL)
_FENCED_BLOCK = re.compile(r"```[a-zA-Z]*\n?(.*?)\n?```", re.DOTALL)


def clean_prediction(text: str) -> str:
    """Think blocks out (case-sensitive), text after a stray closing tag, the first fenced block's
    contents if there is one, then strip (docs/protocols.md, 'Cleaning and comparing the answer')."""
    text = _THINKING_BLOCK.sub("", _THINK_BLOCK.sub("", text))
    for closing in ("</think>", "</thinking>"):
        if closing in text:
            text = text.rsplit(closing, 1)[1].strip()
    fenced = _FENCED_BLOCK.search(text)
    if fenced:
        text = fenced.group(1)
    return text.strip()


def normalize_output(text: str) -> str:
    """All whitespace removed, lower case: the comparison ignores layout and case, nothing else."""
    return "".join(text.split()).lower()


def score_prediction(prediction: str, ground_truth: str) -> float:
    """1.0 when the cleaned prediction matches the ground truth up to whitespace and case, else 0.0."""
    return 1.0 if normalize_output(clean_prediction(prediction)) == normalize_output(ground_truth) else 0.0


def line_credit(prediction: str, ground_truth: str) -> float:
    """Training-only partial credit (not the env's score): the share of output lines right in place, each line
    compared as the score compares the whole (whitespace and case ignored), over the longer of the two, so that
    a reply that runs on past the output loses credit too. Only used where the score is 0 (the score ignores line
    breaks, this does not)."""
    expected = [normalize_output(line) for line in ground_truth.strip().splitlines() if line.strip()]
    predicted = [normalize_output(line) for line in clean_prediction(prediction).splitlines() if line.strip()]
    if not expected and not predicted:
        return 1.0
    right = sum(p == e for p, e in zip(predicted, expected))
    return right / max(len(expected), len(predicted))


def ground_truth_of(run: RunResult) -> tuple[str, str | None]:
    """(ground truth, why the task is degenerate or None) from one sandboxed run (docs/protocols.md, 'Ground truth')."""
    if run.killed_reason in ("timeout", "output_limit", "cpu_time"):  # all three stand for the real env's timeout
        return "", run.killed_reason
    truth = run.stdout.strip()
    if run.returncode != 0:
        return truth, "crashed"
    return truth, None if truth else "empty_output"


def next_task_id(task_id: int, source: str) -> int:
    """The task that replaces a degenerate one: the next row (hf), or the next id of the same
    difficulty level (embedded), wrapping around inside the level's held-out ids for a held-out task and inside
    its training ids for a training task, where it also passes over the held-out tasks' programs."""
    if source == "hf":
        return task_id + 1
    block_start = task_id - task_id % TRACE_LEVEL_STRIDE
    held_out = is_held_out_trace_task(task_id)
    low, high = ((block_start, block_start + TRACE_HELD_OUT) if held_out
                 else (block_start + TRACE_HELD_OUT, block_start + TRACE_LEVEL_STRIDE))
    candidate = task_id
    while True:
        candidate = low + (candidate - low + 1) % (high - low)
        if held_out or not repeats_a_held_out_program(candidate):
            return candidate


# ---------------------------------------------------------------- episodes
@dataclass(frozen=True)
class TraceChallenge:
    task_id: int
    program: str  # the transformed program shown to the model
    inputs: str
    ground_truth: str
    degenerate: str | None  # None, "syntax_error", "crashed", "empty_output", "timeout", ...
    prompt: str
    location: dict[str, int]  # {"difficulty": level} (embedded) or {"dataset_index": row} (hf)


@dataclass
class _Episode:
    challenge: TraceChallenge
    requested_task_id: int
    seed: int
    done: bool = False
    step_count: int = 0
    score: float = 0.0
    last: StepResult | None = field(default=None, repr=False)  # the final step, repeated to late callers


def _error(kind: str, message: str, retryable: bool) -> dict[str, Any]:
    return {"type": kind, "message": message, "retryable": retryable}


class TraceEnv:
    """Single-turn trace episodes behind the async OpenEnv interface of ppo_affine/envs/base.py."""

    def __init__(
        self,
        source: str = "embedded",
        skip_degenerate: bool = False,
        timeout: float = 10.0,
        seed: int = 0,
        dataset_name: str = "satpalsr/rl-python",
        dataset_split: str = "train",
        max_concurrent_runs: int = 4,
        dataset: Any = None,
        sandbox_limits: SandboxLimits = SandboxLimits(),
        unsafe_rlimit_only_sandbox: bool = False,
    ):
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_concurrent_runs < 1:
            raise ValueError(f"max_concurrent_runs must be >= 1, got {max_concurrent_runs}")
        if dataset is not None and source != "hf":
            raise ValueError("dataset rows are only used with source='hf'")
        if not unsafe_rlimit_only_sandbox:
            require_isolation()  # fail at start-up, not at the first episode
        self.use_bwrap = not unsafe_rlimit_only_sandbox
        self.source = source
        self.skip_degenerate = skip_degenerate
        self.timeout = timeout
        self.dataset_name = dataset_name
        self.dataset_split = dataset_split
        self.sandbox_limits = sandbox_limits
        self._dataset = dataset
        self._dataset_lock = asyncio.Lock()
        self._rng = random.Random(seed)  # draws the task ids and seeds that callers leave out
        self._runs = asyncio.Semaphore(max_concurrent_runs)
        self._cache: OrderedDict[tuple, TraceChallenge] = OrderedDict()
        self._building: dict[tuple, asyncio.Task] = {}
        self._episodes: dict[str, _Episode] = {}
        self._finished: OrderedDict[str, _Episode] = OrderedDict()
        self.sandbox_runs = 0  # programs actually executed (cache misses), for metrics and tests

    # -------------------------------------------------------------- protocol
    async def reset(self, task_id: int | None = None, seed: int | None = None, **kwargs: Any) -> StepResult:
        if kwargs:
            raise TypeError(f"TraceEnv.reset() got unexpected arguments {sorted(kwargs)}; it takes task_id and seed")
        space = EMBEDDED_TASK_ID_SPACE if self.source == "embedded" else HF_TASK_ID_SPACE
        task_id = self._rng.randrange(space) if task_id is None else operator.index(task_id)
        seed = self._rng.randrange(SEED_SPACE) if seed is None else operator.index(seed)
        if task_id < 0:
            raise ValueError(f"task_id must be >= 0, got {task_id}")
        try:
            challenge = await self._usable_challenge(task_id)
        except Exception as exc:  # reported in-band like the real env: the trainer retries or drops it
            info = self._blank_info() | {
                "task_id": task_id, "requested_task_id": task_id, "seed": seed,
                "error": _error("generation_error", f"{type(exc).__name__}: {exc}", retryable=True),
            }
            return step_result(f"Error generating challenge: {exc}", done=True, truncated=True, info=info)
        episode_id = uuid.uuid4().hex
        episode = _Episode(challenge, requested_task_id=task_id, seed=seed)
        self._episodes[episode_id] = episode
        return step_result(challenge.prompt, episode_id=episode_id, info=self._info(episode))

    async def step(self, action: str, episode_id: str) -> StepResult:
        episode = self._lookup(episode_id)
        if not isinstance(episode, _Episode):
            return episode
        if episode.done:
            info = self._info(episode) | {
                "error": _error("episode_done", f"episode {episode_id} has finished; call reset()", retryable=False)}
            assert episode.last is not None
            return step_result(episode.last["observation"], reward=episode.score, done=True,
                               episode_id=episode_id, info=info)
        try:
            prediction = clean_prediction(action)
            score = score_prediction(action, episode.challenge.ground_truth)
        except Exception as exc:  # e.g. an action that is not a string; the episode ends with score 0
            episode.done, episode.step_count = True, 1
            info = self._info(episode) | {
                "error": _error("evaluation_error", f"{type(exc).__name__}: {exc}", retryable=False)}
            episode.last = step_result(f"Error evaluating the answer: {exc}", done=True, episode_id=episode_id,
                                       info=info)
            self._retire(episode_id)
            return episode.last
        episode.done, episode.step_count, episode.score = True, 1, score
        report = _report(score, prediction, episode.challenge.ground_truth)
        info = self._info(episode) | {"line_credit": line_credit(action, episode.challenge.ground_truth)}
        episode.last = step_result(report, reward=score, done=True, episode_id=episode_id, info=info)
        self._retire(episode_id)
        return episode.last

    async def state(self, episode_id: str) -> StepResult:
        episode = self._lookup(episode_id)
        if not isinstance(episode, _Episode):
            return episode
        if episode.done:
            observation = f"Episode completed with score {episode.score}."
        else:
            observation = episode.challenge.prompt
        return step_result(observation, reward=0.0, done=episode.done, episode_id=episode_id, info=self._info(episode))

    async def stop(self, episode_id: str) -> dict[str, Any]:
        found = self._episodes.pop(episode_id, None) or self._finished.pop(episode_id, None)
        if found is None:
            return {"status": "ok", "stopped": False, "episode_id": episode_id,
                    "message": f"no episode {episode_id!r}"}
        return {"status": "ok", "stopped": True, "episode_id": episode_id}

    async def close(self) -> None:
        for task in self._building.values():
            task.cancel()
        self._building.clear()
        self._episodes.clear()
        self._finished.clear()

    # -------------------------------------------------------------- challenges
    async def challenge(self, task_id: int) -> TraceChallenge:
        """The challenge of exactly `task_id` (no degenerate skipping), from the cache when built before."""
        key = (self.source, self.dataset_name if self.source == "hf" else None, task_id)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        # Episodes of one group reset the same task together: they share a single sandbox run.
        building = self._building.get(key)
        if building is None:
            building = asyncio.ensure_future(self._build(task_id))
            self._building[key] = building
            building.add_done_callback(lambda done: self._finish_build(key, done))
        return await asyncio.shield(building)

    def _finish_build(self, key: tuple, done: asyncio.Task) -> None:
        self._building.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        self._cache[key] = done.result()
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    async def _usable_challenge(self, task_id: int) -> TraceChallenge:
        candidate = task_id
        for _ in range(MAX_DEGENERATE_SKIPS):
            challenge = await self.challenge(candidate)
            if not (self.skip_degenerate and challenge.degenerate):
                return challenge
            candidate = next_task_id(candidate, self.source)
        raise RuntimeError(
            f"the {MAX_DEGENERATE_SKIPS} tasks from task_id {task_id} on all have an empty, crashing or timed-out "
            f"ground truth; pick other task ids or set skip_degenerate=False"
        )

    async def _build(self, task_id: int) -> TraceChallenge:
        if self.source == "embedded":
            program = generate_program(task_id)
            source, inputs, location = program.source, program.inputs, {"difficulty": program.difficulty}
        else:
            rows = await self._rows()
            index = task_id % len(rows)
            source, inputs = _read_row(rows[index], index, self.dataset_name)
            location = {"dataset_index": index}
        transformed, parsed = inject_debug_prints(source, seed=task_id)
        async with self._runs:
            run = await run_python_async(transformed, inputs, self.timeout, limits=self.sandbox_limits,
                                         use_bwrap=self.use_bwrap)
        self.sandbox_runs += 1
        if run.killed_reason == "launch_error":  # our failure, not the task's: never cache it as an answer
            raise RuntimeError(f"the sandbox could not start the program: {run.stderr.strip()[-300:]}")
        truth, degenerate = ground_truth_of(run)
        if not parsed:
            degenerate = "syntax_error"
        return TraceChallenge(task_id, transformed, inputs, truth, degenerate, build_prompt(transformed, inputs),
                              location)

    async def _rows(self) -> Any:
        async with self._dataset_lock:
            if self._dataset is None:
                self._dataset = await asyncio.to_thread(self._load_dataset)
        if len(self._dataset) == 0:
            raise ValueError(f"trace dataset {self.dataset_name!r} has no rows")
        return self._dataset

    def _load_dataset(self) -> Any:
        try:
            import datasets

            return datasets.load_dataset(self.dataset_name, split=self.dataset_split)
        except Exception as exc:
            raise RuntimeError(
                f"could not load trace dataset {self.dataset_name!r} (split {self.dataset_split!r}): {exc}. "
                "source='hf' needs the dataset in the local Hugging Face cache or access to the Hub "
                "(HF_TOKEN if it is gated); offline, use source='embedded'."
            ) from exc

    # -------------------------------------------------------------- bookkeeping
    def _lookup(self, episode_id: str) -> _Episode | StepResult:
        if not episode_id:
            info = self._blank_info() | {"error": _error("no_episode_id", "episode_id is empty", False)}
            return step_result("Error: no episode_id given; call reset() first.", done=True, truncated=True, info=info)
        episode = self._episodes.get(episode_id) or self._finished.get(episode_id)
        if episode is None:
            return step_result(
                f"Error: unknown episode {episode_id!r} (stopped, never started, or finished long ago).",
                done=True, truncated=True, episode_id=episode_id,
                info=self._blank_info() | {"error": _error("episode_not_found", f"no episode {episode_id!r}", False)})
        return episode

    def _retire(self, episode_id: str) -> None:
        episode = self._episodes.pop(episode_id, None)
        if episode is None:
            return  # stopped while it was being scored
        self._finished[episode_id] = episode
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    def _info(self, episode: _Episode) -> dict[str, Any]:
        challenge = episode.challenge
        info = {
            "task_id": challenge.task_id, "requested_task_id": episode.requested_task_id, "seed": episode.seed,
            "game_name": "trace", "system_prompt": None,
            "turn_prompt": "" if episode.done else challenge.prompt, "parse_error": False,
            "step_count": episode.step_count, "score": episode.score, "degenerate": challenge.degenerate,
            **challenge.location,
        }
        if episode.done:
            info["success"] = episode.score > 0
        return info

    @staticmethod
    def _blank_info() -> dict[str, Any]:
        return {"task_id": None, "seed": None, "game_name": "trace", "system_prompt": None, "turn_prompt": "",
                "parse_error": False, "step_count": 0, "score": 0.0}


def _read_row(row: Any, index: int, dataset_name: str) -> tuple[str, str]:
    try:
        program, inputs = row["program"], row["inputs"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"row {index} of trace dataset {dataset_name!r} lacks 'program'/'inputs': {exc!r}") from None
    return str(program), "" if inputs is None else str(inputs)


def _report(score: float, prediction: str, ground_truth: str) -> str:
    """The step observation: score, test result, and both outputs cut to 500 characters (docs/protocols.md,
    'The trace reset/step protocol')."""
    def cut(text: str) -> str:
        return text[:REPORT_CHARS] + ("..." if len(text) > REPORT_CHARS else "")

    return (
        f"**Score:** {score}\n**Test Result:** {'1/1' if score > 0 else '0/1'}\n\n"
        f"**Your answer:**\n```\n{cut(prediction)}\n```\n\n**Expected output:**\n```\n{cut(ground_truth)}\n```"
    )
