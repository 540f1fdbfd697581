"""The warm start's configuration: what sft_warmstart.py's options say, as one validated model.

Each field is the option of the same name, dashes for underscores (`dagger_rounds` is `--dagger-rounds`; only
`experts` is `--expert`). The fields the command line gives as comma-separated text (games, config ids, per-game
counts, experts, reason games) take that text here too, or the parsed value. What the options' files hold
(played games, conversations) is read by `run.load_inputs` and kept apart: a checkpoint saves this model, not
the data. The trainer's configuration (model, LoRA, generation, the envs) is `ppo_affine.config.Config`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError, field_validator, model_validator

from ppo_affine.config import ConfigError, Strict
from ppo_affine.curriculum_config import Opponent
from ppo_affine.envs.tasks import TRACE_LEVELS

DaggerAggregate = Literal["sft", "all"]
DAGGER_AGGREGATES: tuple[str, ...] = get_args(DaggerAggregate)  # the first is the default
OPTION_NAMES = {"experts": "--expert"}  # the fields whose option is not "--" + the name with dashes


def option_of(field: str) -> str:
    """The command-line option that sets `field`."""
    return OPTION_NAMES.get(field, "--" + field.replace("_", "-"))


def parse_game_counts(text: str, option: str) -> dict[str, int]:
    """'64' or '64,gin_rummy=8' -> {"*": 64, "gin_rummy": 8}; ConfigError naming `option` otherwise."""
    head, *rest = [part.strip() for part in str(text).split(",")]
    try:
        counts = {"*": int(head)}
        for item in rest:
            game, equals, number = item.partition("=")
            if not equals:
                raise ValueError
            counts[game.strip()] = int(number)
    except ValueError:
        raise ConfigError(f"{option}: expected a number, then GAME=N items separated by commas, got {text!r}.") from None
    return counts


def parse_integers(text: str, option: str, expected: str) -> list[int]:
    """'0,1' -> [0, 1]; ConfigError naming `option` and what it `expected` otherwise."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option}: expected {expected}, got {text!r}.") from None


def parse_experts(text: str) -> dict[str, str]:
    """'leduc_poker=best_response,gin_rummy=mcts' -> {game: kind}; ConfigError naming --expert otherwise."""
    experts = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        game, equals, kind = item.partition("=")
        if not equals or not game or not kind:
            raise ConfigError(f"--expert: expected GAME=KIND items separated by commas, got {item!r}.")
        experts[game.strip()] = kind.strip()
    return experts


def parse_reason_games(text: str, games: list[str]) -> set[str]:
    """--reason's value: '' -> no game, '*' -> every game, 'a,b' -> those games (ConfigError for a game not played)."""
    if text.strip() == "*":
        return set(games)
    named = {game.strip() for game in text.split(",") if game.strip()}
    if named - set(games):
        raise ConfigError(f"--reason: {sorted(named - set(games))} are not in --games ({','.join(games)}).")
    return named


def game_count(counts: int | dict[str, int], game: str) -> int:
    """A per-game count ({game: n} with "*" for the others, or one number) for `game`."""
    return counts.get(game, counts["*"]) if isinstance(counts, dict) else counts


def option_text(value: Any) -> str:
    """A field's value as its option's text: items comma-separated, a per-game count's "*" first and bare."""
    if isinstance(value, dict):
        star_first = sorted(value.items(), key=lambda item: item[0] != "*")
        return ",".join(str(v) if k == "*" else f"{k}={v}" for k, v in star_first)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _parsed(parse, *arguments):
    """A text parser's result, its ConfigError as the ValueError pydantic reports (with the option named)."""
    try:
        return parse(*arguments)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class WarmStartConfig(Strict):
    """sft_warmstart.py's options: the expert games, the relabelled games, the DAgger rounds and the SFT."""

    games: list[str] = Field(["leduc_poker", "liars_dice", "goofspiel"],
                             description="comma-separated games with an expert")
    episodes: dict[str, int] = Field(
        {"*": 100}, description="expert episodes per game: a number, or a number then GAME=N for the games that "
        "differ (e.g. 64,gin_rummy=8)")
    config_ids: list[int] = Field([0], min_length=1, description="comma-separated game variants to cycle through")
    opponent: Opponent = Field("random", description="the env's opponent")
    opponent_simulations: int | None = Field(
        None, ge=1, description="MCTS opponent's simulations (default: the config's "
        "env.envs.<openspiel env>.mcts_simulations, else each game's validator budget)")
    expert_budget: int | None = Field(
        None, ge=1, description="MCTS simulations (default 300) or Monte Carlo playouts per bid (default 20)")
    experts: dict[str, str] = Field({}, description="experts other than a game's default (the first listed)")
    cfr_iterations: int = Field(300, ge=1, description="CFR+ iterations for leduc_poker")
    reason: list[str] = Field(
        [], description="replies '<think>one-line reason</think>ID': in every game ('*', the option alone), or only "
        "in the comma-separated GAMES (e.g. --reason goofspiel); the others reply with the ID alone")
    explore: float = Field(
        0.0, description="chance that a turn of an expert game plays a random legal move, not trained on: SFT then "
        "also sees the expert recover from states its own play never reaches (e.g. 0.2)")
    openings: dict[str, int] = Field(
        {"*": 0}, description="more expert episodes per game, cut after the expert's first reply (a number, or a "
        "number then GAME=N items): the decision that decides short games, such as a liars_dice opening bid, at "
        "one prompt each")
    trace: int = Field(
        0, ge=0, description="trace tasks whose reply the interpreter writes: the program's real stdout in a fenced "
        "block, the form the trace env scores, on the env's own prompt; task ids of their own, never the held-out "
        "ones evaluation plays (with --games '' the only data)")
    trace_levels: list[int] = Field(
        [0, 1], min_length=1, description=f"comma-separated trace levels from {TRACE_LEVELS} that --trace's tasks "
        "cycle through")
    data: Path | None = Field(None, description="train on this JSONL instead of generating episodes (default: none: "
                              "expert games are played)")
    relabel: list[str] = Field(
        [], description="also train on the games a model played (evaluate.py's episodes.jsonl played with --seed S; "
        ":MODEL keeps that model's records), replayed with each game's expert answering at every turn (DAgger): the "
        "expert's moves at the states the model's own play reaches. Games on evaluation seeds (the validators' or "
        "bench/learning.py's held-out ones) are refused: that would train on the test. Repeatable; with "
        "--episodes 0 and no --data, the only data")
    relabel_missed_only: bool = Field(
        False, description="of the relabelled games keep only the turns where the model missed the expert's move "
        "(about half the sequences). Measured worse on leduc_poker: 0.496 against 0.543 with every turn relabelled "
        "(-0.024 [-0.04, -0.01] paired; labels drawn from the misses alone taught 'raise and fold more', not "
        "where; docs/warm_start.md); kept to compare the two")
    dagger_rounds: int = Field(
        0, ge=0, description="after the SFT, N rounds of DAgger: the newest adapter plays --dagger-episodes games "
        "greedily against --opponent on seeds of their own, each game's expert relabels them (as --relabel), and "
        "SFT goes on from that adapter on them and on this call's SFT conversations (and --dagger-data's) for "
        "--epochs. With --init-adapter and --episodes 0 the rounds start from that adapter, with no SFT before "
        "them: also the way to go on after an interrupted run, from its last round's checkpoint (new deals). "
        "--dagger-aggregate all adds earlier rounds' relabelled games")
    dagger_episodes: dict[str, int] = Field(
        {"*": 128}, description="games per game and round for --dagger-rounds: a number, or a number then GAME=N "
        "items")
    dagger_data: Path | None = Field(
        None, description="expert conversations (an sft_data.jsonl) that every --dagger-rounds round trains on "
        "beside its relabelled games, e.g. the games an --init-adapter learned from: the turns it plays right stay "
        "held in place (an SFT in the same call keeps its own data this way; a conversation in both trains once) (default: none)")
    dagger_aggregate: DaggerAggregate = Field(
        DAGGER_AGGREGATES[0], description="what each --dagger-rounds round trains on beside its own relabelled "
        "games: 'sft', this call's SFT data (expert games, --data, --relabel) and --dagger-data's (measured on "
        "leduc_poker: +0.011 [0.00, 0.02] over the rounds' games alone); 'all', also every earlier round's "
        "relabelled games, as DAgger aggregates. Measured worse on leduc_poker: 0.511, -0.050 [-0.07, -0.03] "
        "against 'sft', 13 of 256 games forfeited by raising past the cap (docs/warm_start.md); kept as DAgger's "
        "own form to compare against")
    init_adapter: Path | None = Field(
        None, description="go on training this adapter (an earlier SFT checkpoint, or an adapter folder) instead "
        "of a fresh LoRA, e.g. for more epochs (default: none: a fresh LoRA)")
    workers: int = Field(None, ge=1, validate_default=True,
                         description="processes playing and replaying games (default: one per core)")
    epochs: int = Field(2, ge=1, description="passes over the expert conversations")
    learning_rate: float = Field(2e-4, gt=0, description="the LoRA adapter's AdamW learning rate")
    batch_size: int = Field(16, ge=1, description="conversations per optimizer step")
    output_dir: Path = Field(Path("runs/sft-warmstart"), description="where the expert data (sft_data.jsonl), the "
                             "SFT metrics and checkpoints/ go")

    @classmethod
    def from_options(cls, **values: Any) -> WarmStartConfig:
        """The model from option values, as text or parsed; a ConfigError of one line naming the option."""
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    def with_reason(self, game: str) -> bool:
        """Whether `game`'s replies carry a reason (--reason)."""
        return "*" in self.reason or game in self.reason

    @field_validator("games", mode="before")
    @classmethod
    def _games_from_text(cls, value: Any) -> Any:
        return [g.strip() for g in value.split(",") if g.strip()] if isinstance(value, str) else value

    @field_validator("config_ids", mode="before")
    @classmethod
    def _config_ids_from_text(cls, value: Any) -> Any:
        return _parsed(parse_integers, value, "--config-ids", "comma-separated integers") if isinstance(value, str) \
            else value

    @field_validator("trace_levels", mode="before")
    @classmethod
    def _trace_levels_from_text(cls, value: Any) -> Any:
        return (_parsed(parse_integers, value, "--trace-levels", f"comma-separated levels from {TRACE_LEVELS}")
                if isinstance(value, str) else value)

    @field_validator("trace_levels")
    @classmethod
    def _trace_levels_exist(cls, levels: list[int]) -> list[int]:
        if any(level not in TRACE_LEVELS for level in levels):
            raise ValueError(f"--trace-levels: {levels} are not all in {TRACE_LEVELS}.")
        return levels

    @field_validator("episodes", "openings", "dagger_episodes", mode="before")
    @classmethod
    def _counts_from_text(cls, value: Any, info) -> Any:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return _parsed(parse_game_counts, str(value), option_of(info.field_name))
        return value

    @field_validator("episodes", "openings", "dagger_episodes")
    @classmethod
    def _counts_cover_every_game(cls, counts: dict[str, int], info) -> dict[str, int]:
        if "*" not in counts:
            raise ValueError(f"{option_of(info.field_name)}: needs a count for the games not named ('*'), got "
                             f"{counts}.")
        least = {"openings": 0, "dagger_episodes": 1}.get(info.field_name)  # --episodes: see _games_can_be_played
        if least is not None and min(counts.values()) < least:
            raise ValueError(f"{option_of(info.field_name)} must be at least {least} for every game, got {counts}.")
        return counts

    @field_validator("experts", mode="before")
    @classmethod
    def _experts_from_text(cls, value: Any) -> Any:
        return _parsed(parse_experts, value) if isinstance(value, str) else value

    @field_validator("experts")
    @classmethod
    def _experts_exist(cls, experts: dict[str, str]) -> dict[str, str]:
        from ppo_affine.experts import ExpertUnavailable, expert_kind

        for game in experts:
            try:
                expert_kind(game, experts)
            except ExpertUnavailable as exc:
                raise ValueError(f"--expert: {exc}.") from None
        return experts

    @field_validator("reason", mode="before")
    @classmethod
    def _reason_from_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        return ["*"] if value.strip() == "*" else [game.strip() for game in value.split(",") if game.strip()]

    @field_validator("explore")
    @classmethod
    def _explore_is_a_chance(cls, explore: float) -> float:
        if not 0 <= explore < 1:
            raise ValueError(f"--explore must be in [0, 1), got {explore}.")
        return explore

    @field_validator("workers", mode="before")
    @classmethod
    def _every_core_by_default(cls, workers: Any) -> Any:
        return (os.cpu_count() or 1) if workers is None else workers

    @model_validator(mode="after")
    def _dagger_options_need_rounds(self) -> WarmStartConfig:
        if self.dagger_aggregate == "all" and not self.dagger_rounds:
            raise ValueError("--dagger-aggregate all keeps earlier rounds' games, but --dagger-rounds is 0.")
        if self.dagger_data is not None and not self.dagger_rounds:
            raise ValueError("--dagger-data trains in every --dagger-rounds round, but --dagger-rounds is 0.")
        return self

    @model_validator(mode="after")
    def _games_can_be_played(self) -> WarmStartConfig:
        """The teachers play --games when no --data replaces the expert games, and in every DAgger round."""
        if self.data is not None and not self.dagger_rounds:
            return self
        if not self.games and self.trace and not self.dagger_rounds:  # the interpreter's trace records alone
            return self
        # DAgger rounds may start from --init-adapter alone, and --relabel's games may be the only data
        starts_elsewhere = self.relabel or (self.dagger_rounds and self.init_adapter is not None)
        if self.data is None and min(self.episodes.values()) < (0 if starts_elsewhere else 1):
            raise ValueError(f"--episodes must be at least 1 for every game, got {self.episodes}.")
        if not self.games:
            raise ValueError("--games is empty; name games with an expert, e.g. --games leduc_poker,goofspiel "
                             "(or ask for trace records alone: --games '' --trace N).")
        from ppo_affine.experts import ExpertUnavailable, expert_kind

        for game in self.games:
            try:
                expert_kind(game, self.experts)
            except ExpertUnavailable as exc:
                raise ValueError(f"--games: {exc}.") from None
        return self

    @model_validator(mode="after")
    def _reasons_name_games_played(self) -> WarmStartConfig:
        if self.data is None:
            _parsed(parse_reason_games, ",".join(self.reason), self.games)
        return self


def _explain(error: ValidationError) -> str:
    """The first problem, in one line that names the option."""
    problem = error.errors()[0]
    if problem["type"] == "value_error":  # the validators' own messages name the option
        return str(problem["ctx"]["error"])
    option = option_of(str(problem["loc"][0])) if problem["loc"] else "the warm start's options"
    given, bounds = problem.get("input"), problem.get("ctx", {})
    if problem["type"] == "greater_than_equal":
        return f"{option} must be at least {bounds['ge']:g}, got {given}."
    if problem["type"] == "greater_than":
        return f"{option} must be > {bounds['gt']:g}, got {given}."
    return f"{option}: {problem['msg'][0].lower()}{problem['msg'][1:]}, got {given!r}."
