"""What a run tells the person watching it: a line per step on standard output (failures alone go to standard
error), a rollout progress bar, a closing summary, and in the run folder `metrics.jsonl` and `train.log` (every
line the run printed, with its time: the lines before the run folder was known are held and written first), plus
Weights & Biases when configured."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from ppo_affine.config import LoggingConfig
from ppo_affine.file_writes import WriteFailed, writing

console = Console()  # what a run says goes to standard output: `python train_ppo.py > log` keeps it
error_console = Console(stderr=True)  # the one line of a failure
PLAIN_PROGRESS_SECONDS = 60.0
LOG_FILE = "train.log"
SAMPLES_FILE = "samples.jsonl"
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def setup_logging(level: int = logging.INFO, prefix: str = "") -> None:
    """Console logging on standard output (rich in a terminal; plain lines with their time in a file or pipe, never
    wrapped); `prefix` marks the lines of one rank among several."""
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        logging.basicConfig(level=level, format=prefix + "%(message)s", datefmt="[%X]", handlers=[handler], force=True)
    else:
        handler = logging.StreamHandler(sys.stdout)
        logging.basicConfig(level=level, format=prefix + PLAIN_FORMAT, datefmt="%H:%M:%S", handlers=[handler],
                            force=True)
    for noisy in ("httpx", "urllib3", "filelock", "transformers", "datasets", "affinetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    silence_known_library_warnings()


def report_failure(heading: str, problem: BaseException | str, exit_code: int, shown: bool = True) -> int:
    """A program's failure as one red `heading:` line (the message escaped: a `[...]` in it is text, not
    markup), in train.log too while one is open; returns the exit code. `shown=False` (another rank than the one that
    reports) prints nothing."""
    if shown:
        error_console.print(f"[red]{heading}:[/red] {escape(str(problem))}", highlight=False, soft_wrap=True)
        to_run_log(f"{heading}: {problem}", logging.ERROR)
    return exit_code


class _HeldLines(logging.Handler):
    """The log records of a run before its folder (and so train.log) is known: resolving a checkpoint, setting a
    corrupt one aside, the start-up checks' warnings."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _RunLogFile(logging.FileHandler):
    """train.log. A write that fails (a full disk) is kept and raised at the next step (`check_run_log`), not printed
    as a traceback under every later line, as logging would."""

    failure: BaseException | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failure is None:
            self.failure = sys.exc_info()[1]


_held: _HeldLines | None = None
_run_log: _RunLogFile | None = None


def hold_lines_for_the_run_log() -> None:
    """From now on every log line (and every warning) is kept for train.log, which `open_run_log` starts with them."""
    global _held
    logging.captureWarnings(True)  # a library's warning is a line the console shows: train.log holds it too
    _held = _HeldLines()
    logging.getLogger().addHandler(_held)


def open_run_log(run_dir: Path) -> None:
    """Append to `run_dir`/train.log from now on (a resumed run appends), the held lines first."""
    global _held, _run_log
    with writing("the run log", run_dir / LOG_FILE):
        handler = _RunLogFile(run_dir / LOG_FILE, encoding="utf-8")
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    if _held is not None:
        logging.getLogger().removeHandler(_held)
        for record in _held.records:
            handler.handle(record)
        _held = None
    logging.getLogger().addHandler(handler)
    _run_log = handler


def close_run_log() -> None:
    global _held, _run_log
    for handler in (_held, _run_log):
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
    _held = _run_log = None
    logging.captureWarnings(False)


def check_run_log() -> None:
    """WriteFailed when a line could not be written to train.log."""
    if _run_log is not None and _run_log.failure is not None:
        raise WriteFailed(f"Could not write the run log {_run_log.baseFilename}: {_run_log.failure}")


def to_run_log(text: str, level: int = logging.INFO, level_name: str | None = None) -> None:
    """A line that goes to the console by other means (a step line, the summary, a failure) into train.log too."""
    target = _run_log or _held
    if target is not None:
        target.handle(logging.makeLogRecord({"msg": text, "levelname": level_name or logging.getLevelName(level),
                                             "levelno": level, "name": "run"}))


def say(text: str, style: str | None = None) -> None:
    """A line of plain text (brackets are text, not markup) on the console, in `style`, and in train.log."""
    console.print(Text(text, style=style or ""), highlight=False, soft_wrap=True, emoji=False)
    to_run_log(text)


def silence_known_library_warnings() -> None:
    """Warnings that libraries print about themselves, which users read as faults of the run."""
    # peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # bitsandbytes' notice about an optional CPU kernel package is dropped in ppo_affine/__init__.py, at import


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, config_dump: dict[str, Any], wandb_id: str | None = None,
                 resumed_step: int = 0, fresh: bool = False):
        """`fresh`: a new run, not a resumed one; metrics.jsonl and samples.jsonl of an earlier run in its folder are
        renamed, not written over or appended to."""
        self.run_dir = run_dir
        self.model = (config_dump.get("train") or {}).get("model")  # samples name it: episodes.py loads its tokenizer
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        with writing("the metrics", self.metrics_path):
            if fresh:
                self._set_aside_earlier_files()
            else:
                self._truncate_after(resumed_step)  # lines after the checkpoint we start from belong to no run now
        self.last_step: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self.wandb_run = None
        self.wandb_id = wandb_id
        if cfg.wandb_project and cfg.wandb_mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(run_dir),
                                        config=config_dump, id=wandb_id, resume="allow", name=run_dir.name)
            self.wandb_id = self.wandb_run.id

    def _set_aside_earlier_files(self) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in (self.metrics_path, self.run_dir / SAMPLES_FILE):
            if path.exists():
                kept = path.with_name(f"{path.stem}.before-{stamp}{path.suffix}")
                os.replace(path, kept)
                logging.getLogger(__name__).warning(
                    "%s already held %s of an earlier run: renamed to %s, this run starts a new one", self.run_dir,
                    path.name, kept.name)

    def _truncate_after(self, step: int) -> None:
        """In metrics.jsonl and samples.jsonl keep the lines of steps up to `step`; a line torn by a kill mid-write
        is dropped too. The resumed run plays the later steps again: their old samples kept beside the new ones
        would give the merge's calibration the same step twice, once on each side of its held-out split."""
        for path in (self.metrics_path, self.run_dir / SAMPLES_FILE):
            if not path.exists():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except ValueError:
                    continue
            staging = path.with_suffix(".jsonl.tmp")
            staging.write_text("".join(line + "\n" for line in kept))
            os.replace(staging, path)  # a kill now leaves the old or the new file, never half of one

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with writing("the metrics", self.metrics_path), open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        line = self.step_line(step, metrics)
        console.print(line, highlight=False, soft_wrap=True)
        to_run_log(line, level_name="STEP")
        check_run_log()
        self.last_step, self.last_metrics = step, record

    def log_sample(self, step: int, episode, index: int = 0) -> None:
        """One played episode (the step's `index`-th): its conversation, and each model call as recorded (prompt
        and sampled ids, decoded and parsed reply, log-probs, adapter step, reward) for `python -m
        ppo_affine.episodes show`."""
        record = {"step": step, "episode": index, "env": episode.task.env, "task_id": episode.task.task_id,
                  "seed": episode.task.seed, "game": episode.game_name, "score": episode.score, "error": episode.error,
                  "cut_off": episode.cut_off, "model": self.model, "messages": episode.messages,
                  "calls": recorded_calls(episode)}
        path = self.run_dir / SAMPLES_FILE
        with writing("the samples", path), open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    @staticmethod
    def step_line(step: int, m: dict[str, Any]) -> str:
        def f(key: str, fmt: str = ".3f") -> str:
            value = m.get(key)
            return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)

        return (
            f"step {step:>5} | reward {f('env/reward_mean')} | score {f('env/score_mean')} | "
            f"success {f('env/success_rate', '.2f')} | illegal {f('env/illegal_rate', '.2f')} | "
            f"kl/token {f('reward/kl_per_token', '.4f')} | beta {f('kl/coef', '.4f')} | "
            f"stage {m.get('curriculum/stage', '-')} | tok/s {f('perf/tokens_per_s', '.1f')}"
        )

    def summary(self, checkpoint: Path | None) -> list[str]:
        """The closing lines of a run: where everything is, and the last step's headline numbers."""
        m = self.last_metrics
        lines = [f"run folder:  {self.run_dir}",
                 f"checkpoint:  {checkpoint if checkpoint is not None else 'none saved'}",
                 f"metrics:     {self.metrics_path} (plots: python visualize.py --run-dir {self.run_dir})",
                 f"log:         {self.run_dir / LOG_FILE}"]
        if self.last_step is not None:
            def number(key: str) -> str:
                value = m.get(key)
                return "-" if value is None else f"{value:.3f}"

            lines.append(f"last step:   {self.last_step}: score {number('env/score_mean')}, success "
                         f"{number('env/success_rate')}, illegal {number('env/illegal_rate')}, kl/token "
                         f"{number('reward/kl_per_token')}")
        return lines

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def opponent_seconds(episodes) -> float:
    """The game opponents' own move time summed over `episodes` (envs that do not report it add nothing)."""
    return sum(e.info.get("opponent_seconds", 0.0) for e in episodes)


def steps_behind(episodes, policy_step: int) -> dict[str, float]:
    """How many updates behind the policy about to be updated (after `policy_step` updates) the adapters that wrote
    the replies were: mean and most over the replies a vLLM server wrote (none: the trainer sampled them itself).
    0 when rollout and update take turns; 1 under `async_steps: 1` from the second update on."""
    behind = [policy_step - turn.adapter_step for episode in episodes for turn in episode.turns
              if turn.adapter_step is not None]
    if not behind:
        return {}
    return {"async/steps_behind_mean": sum(behind) / len(behind), "async/steps_behind_max": float(max(behind))}


def recorded_calls(episode) -> list[dict[str, Any]]:
    """Each model call of an episode as the rollout recorded it: an evaluate episode's endpoint calls (with the
    request, to re-render it), a native episode's turns."""
    calls = []
    for n, turn in enumerate(episode.turns):
        call = {"prompt_ids": episode.prompt_ids(turn), "token_ids": list(turn.response_ids),
                "text": turn.response_text, "logprobs": turn.sampler_logprobs, "adapter_step": turn.adapter_step,
                "reward": turn.reward}
        if n < len(episode.calls):  # endpoint calls: one per turn, in order
            record = episode.calls[n]
            call.update(prompt_ids=list(record.prompt_ids), finish_reason=record.finish_reason,
                        parsed=record.parsed, request=record.request)
        calls.append(call)
    return calls


def episode_summary(episodes, rollout_seconds: float, rewards: dict[int, float]) -> dict[str, Any]:
    """The env/ and perf/ numbers of one step's episodes; `rewards` maps id(episode) to its total reward."""
    ok = [e for e in episodes if not e.error]
    turns = sum(len(e.turns) for e in ok)
    tokens = sum(e.generated_tokens for e in episodes)
    metrics: dict[str, Any] = {
        "env/episodes": len(episodes),
        "env/episodes_failed": len(episodes) - len(ok),
        "env/episodes_cut_off": sum(e.cut_off for e in episodes),
        "env/episodes_replayed": sum(e.replays for e in episodes),  # lost by a server, played again
        "env/score_mean": _mean([e.score for e in ok]),
        "env/reward_mean": _mean([rewards[id(e)] for e in ok]),
        "env/success_rate": _mean([float(e.success) for e in ok]),
        "env/illegal_rate": sum(e.illegal_moves for e in ok) / turns if turns else 0.0,
        "env/turns_mean": _mean([len(e.turns) for e in ok]),
        "env/response_length": tokens / max(1, sum(len(e.turns) for e in episodes)),
        "perf/rollout_seconds": rollout_seconds,
        # the game opponents' own time over the step's episodes (searches of concurrent episodes overlap
        # on worker processes, so this can exceed the rollout's wall time)
        "perf/opponent_seconds": opponent_seconds(episodes),
        "perf/tokens_per_s": tokens / rollout_seconds if rollout_seconds > 0 else 0.0,
    }
    harnessed = [e for e in episodes if e.env_kind == "evaluate"]
    if harnessed:  # envs that run the conversation themselves (rollout.play_through_evaluate)
        metrics["evaluate/calls"] = sum(e.info.get("calls", 0) for e in harnessed)
        metrics["evaluate/prefix_breaks"] = sum(e.info.get("prefix_breaks", 0) for e in harnessed)
        # cut off at the endpoint's limits (context, max_turns): not trained on, not failures
        metrics["evaluate/cut_off_rate"] = sum(bool(e.info.get("cut_off")) for e in harnessed) / len(harnessed)
        for episode in harnessed:
            if episode.info.get("fault"):
                key = f"evaluate/dropped/{episode.info['fault']}"
                metrics[key] = metrics.get(key, 0) + 1
    for prefix, key in (("game", lambda e: e.game_name), ("stage", lambda e: e.task.stage)):
        groups: dict[str, list] = {}
        for episode in ok:
            groups.setdefault(key(episode), []).append(episode)
        for name, group in groups.items():
            if prefix == "game":
                metrics[f"game/{name}/score"] = _mean([e.score for e in group])
            metrics[f"{prefix}/{name}/success"] = _mean([float(e.success) for e in group])
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@contextmanager
def rollout_progress(total: int, description: str, visible: bool = True) -> Iterator[Any]:
    """A progress bar over finished episodes; yields a callback to advance it. Without a terminal (a
    log file, a pipe) the bar is invisible, so a plain line every minute shows that long work moves.
    `visible=False` shows nothing (the ranks other than 0 of a data-parallel run)."""
    if not visible:
        yield lambda *_: None
        return
    if not console.is_terminal:
        started = last = time.monotonic()
        done = 0

        def advance(*_: Any) -> None:
            nonlocal done, last
            done += 1
            now = time.monotonic()
            if now - last >= PLAIN_PROGRESS_SECONDS and done < total:
                last = now
                say(f"{description}: {done}/{total} ({now - started:.0f} s)")

        yield advance
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda *_: progress.advance(task)
