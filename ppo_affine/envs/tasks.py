"""Task-id arithmetic shared by the envs, the curriculum and evaluation (no heavy imports)."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from ppo_affine.seeds import derive_seed

# The Affine game env's fixed game order; task_id // 100_000_000 indexes it modulo 22.
AVAILABLE_GAMES: list[str] = [
    "goofspiel", "liars_dice", "leduc_poker", "gin_rummy", "othello", "backgammon", "hex",
    "clobber", "hearts", "euchre", "dots_and_boxes", "go", "chess", "checkers", "quoridor",
    "blackjack", "phantom_ttt", "2048", "solitaire", "bridge", "amazons", "oware",
]
GAME_ID_STRIDE = 100_000_000

# Players per game where it is not two (the same for every variant; tests/test_openspiel_env.py loads each to check).
# The env seats the model at seed mod this number (evaluate(): (seed mod 2) mod it).
OTHER_PLAYER_COUNTS: dict[str, int] = {"hearts": 4, "euchre": 4, "bridge": 4, "blackjack": 1, "2048": 1, "solitaire": 1}

# Embedded trace tasks: each difficulty level (0 = a starter level, 1 = easy .. 3 = hard) owns a block of R ids.
# Levels 1-3 own [(L-1)*R, L*R); level 0 came later and owns the fourth block, [3R, 4R), so that the ids of levels
# 1-3 kept their programs. Ids past 4R wrap around the four blocks.
TRACE_LEVEL_STRIDE = 1_000_000
TRACE_LEVELS = (0, 1, 2, 3)
_TRACE_LEVEL_BLOCKS = (1, 2, 3, 0)  # the level of block 0, 1, 2, 3


def game_task_id(game_name: str, config_id: int = 0) -> int:
    """Task id of `game_name` with parameter variant `config_id`."""
    if game_name not in AVAILABLE_GAMES:
        raise ValueError(f"unknown game {game_name!r}; expected one of {AVAILABLE_GAMES}")
    if not 0 <= config_id < GAME_ID_STRIDE:
        raise ValueError(f"config_id must be in [0, {GAME_ID_STRIDE}), got {config_id}")
    return AVAILABLE_GAMES.index(game_name) * GAME_ID_STRIDE + config_id


def players_of(game_name: str) -> int:
    return OTHER_PLAYER_COUNTS.get(game_name, 2)


def game_name_of(task_id: int) -> str:
    return AVAILABLE_GAMES[(task_id // GAME_ID_STRIDE) % len(AVAILABLE_GAMES)]


def trace_level_range(level: int) -> tuple[int, int]:
    """Half-open task-id range of embedded trace tasks at difficulty `level`."""
    if level not in TRACE_LEVELS:
        raise ValueError(f"trace difficulty must be one of {TRACE_LEVELS}, got {level}")
    block = _TRACE_LEVEL_BLOCKS.index(level)
    return (block * TRACE_LEVEL_STRIDE, (block + 1) * TRACE_LEVEL_STRIDE)


# The first TRACE_HELD_OUT ids of each level's block are the held-out tasks results are judged on (evaluate.py's
# `--games trace` plays from the start of each block); the curriculum and the interpreter teacher draw above them.
TRACE_HELD_OUT = 10_000


def trace_training_range(level: int) -> tuple[int, int]:
    """Half-open task-id range that training draws `level`'s trace tasks from: the level's block less its
    held-out start."""
    low, high = trace_level_range(level)
    return (low + TRACE_HELD_OUT, high)


def is_held_out_trace_task(task_id: int) -> bool:
    return task_id % TRACE_LEVEL_STRIDE < TRACE_HELD_OUT


def trace_level_of(task_id: int) -> int:
    return _TRACE_LEVEL_BLOCKS[(task_id // TRACE_LEVEL_STRIDE) % len(_TRACE_LEVEL_BLOCKS)]


def validator_seed(env_name: str, task_id: int) -> int:
    """The seed Affine validators derive when none is given: sha256("<env>:<task_id>") mod 2**32."""
    digest = hashlib.sha256(f"{env_name}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**32


# Seeds derived from a base for evaluation (evaluate.py --seed, bench/learning.py's held-out games) stay below
# this: the game env adds up to seed + 9 to a seed, and RandomState takes < 2**32.
SEED_LIMIT = 2**32 - 16
# bench/learning.py's held-out evaluation seeds derive from these bases, one per block; training draws its seeds
# elsewhere. Recipes are compared on the tuning block; the confirmation block judges a chosen recipe once, on seeds
# that no choice has seen.
HELD_OUT_SEED_BASE = 900_000
CONFIRMATION_SEED_BASE = 910_000
EVALUATION_BLOCKS = {"tuning": HELD_OUT_SEED_BASE, "confirmation": CONFIRMATION_SEED_BASE}
HELD_OUT_SEEDS_CHECKED = 10_000  # how many of each game's held-out seeds per block a training input is checked against


def paired_seed(base_seed: int, key: str, index: int) -> int:
    """A seed derived from `base_seed` whose parity is `index % 2`, so consecutive episodes change seats."""
    return (derive_seed(base_seed, key, index) % SEED_LIMIT) & ~1 | (index % 2)


@functools.lru_cache(maxsize=None)
def _held_out_seeds(game: str) -> frozenset[int]:
    return frozenset(paired_seed(base, game, i) for base in EVALUATION_BLOCKS.values()
                     for i in range(HELD_OUT_SEEDS_CHECKED))


def is_evaluation_seed(game: str, task_id: int, seed: int) -> bool:
    """Whether a game on (`task_id`, `seed`) is one the results are judged on: the validators' own seed of that
    task, or one of bench/learning.py's held-out seeds (either block). Training on it would train on the test."""
    return seed == validator_seed("game", task_id) or seed in _held_out_seeds(game)


@dataclass(frozen=True)
class Task:
    """One episode to play: which env and task, its seed and opponent, where it was drawn from."""

    env: str
    task_id: int
    seed: int
    opponent: str | None
    stage: str
    replay: bool
