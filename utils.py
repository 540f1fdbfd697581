"""The programs' shared command-line handling of the configuration: the config-file options every program
takes and the helpers that turn them into a validated `Config` (the models live in `ppo_affine/config.py`), on
its own or around a checkpoint that fixes the model."""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ppo_affine.config import (
    PRESET_DIR, Config, ConfigError, load_config, override_location, parse_override, read_preset,
)


class _DefaultsShown(argparse.HelpFormatter):
    """Each option's help followed by its default: the value, 'off' for a flag, 'none' for a repeatable option; an
    option without one says in its own help what happens when it is left out (tests/test_help.py checks both)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "(default" in text or "required" in text or action.default == argparse.SUPPRESS:
            return text
        if action.required:
            return text + " (required)"
        if action.default is False and action.nargs == 0:
            return text + " (default: off)"
        if action.default in ([], ""):
            return text + " (default: none)"
        if action.default is not None:
            return text + " (default: %(default)s)"
        return text


def program_parser(docstring: str) -> argparse.ArgumentParser:
    """Every program's parser: its docstring's first paragraph as the description, each option's default shown."""
    description = " ".join(docstring.split("\n\n")[0].split())
    return argparse.ArgumentParser(description=description, formatter_class=_DefaultsShown)


def add_config_arguments(parser: argparse.ArgumentParser, set_example: str) -> None:
    """The config-file options every CLI shares (`load_config`'s inputs); `set_example` shows a typical --set."""
    parser.add_argument("--config", help="train config JSON (default config/train_config.json)")
    parser.add_argument("--env-config", help="env config JSON (default config/env_config.json)")
    parser.add_argument("--curriculum-config", help="curriculum config JSON (default config/curriculum_config.json)")
    presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.json")))
    parser.add_argument("--preset", action="append", default=[],
                        help=f"preset name (config/presets/NAME.json: {presets}) or a JSON file; repeatable, merged "
                        "in order")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one config field, e.g. --set {set_example} (repeatable)")


def config_from_arguments(args: argparse.Namespace, defaults: Sequence[str] = (), flags: Sequence[str] = ()
                          ) -> Config:
    """The configuration `add_config_arguments`' options name. Overrides apply in this order: the program's
    `defaults`, the user's --set, then the program's own flags as overrides (so an explicit flag wins)."""
    return load_config(args.config, args.env_config, args.curriculum_config, args.preset,
                       [*defaults, *args.set, *flags])


# What an adapter was trained on and the shape it has: the checkpoint's values stand, and another value given
# explicitly is an error (the adapter would not fit, or would be judged on another model).
BOUND_TO_CHECKPOINT = ("model.name_or_path", "model.gguf_file", "model.gguf_package", "model.use_4bit",
                       "lora.r", "lora.alpha", "lora.target_modules", "lora.adapt_experts")
# How that model was loaded, prompted and run: read from the checkpoint unless given explicitly, so that evaluate.py,
# merge.py and --init-adapter run a checkpoint as its run did (a vLLM server the run started is started again). How
# the validators converse (temperature, context) stays each program's own.
CARRIED_FROM_CHECKPOINT = (
    "model.dtype", "model.trust_remote_code", "model.chat_template_kwargs", "model.cache_dir", "run.device",
    "generation.backend", "generation.max_new_tokens", "generation.max_prompt_tokens",
    "generation.stop_at_closing_fence",
    "generation.vllm_server.python", "generation.vllm_server.module",
    "generation.vllm_server.gpu_memory_utilization", "generation.vllm_server.env", "generation.vllm_server.extra_args",
    "generation.vllm_server.start_timeout_seconds",
)


def config_for_checkpoint(args: argparse.Namespace, checkpoint: Path, defaults: Sequence[str] = (),
                          flags: Sequence[str] = (), continue_run: bool = False) -> Config:
    """The configuration for a program that reads `checkpoint`: its base model and LoRA come from the checkpoint,
    so no preset has to be repeated. `continue_run` (resume) starts from the whole saved configuration instead of
    the config files; the user's presets, --set and the program's flags go on top either way. A folder without a
    saved configuration (a bare adapter) gives the plain `config_from_arguments`."""
    from ppo_affine.checkpoint import saved_config  # torch: only the programs that read a checkpoint load it

    saved = saved_config(checkpoint)
    if saved is None:
        return config_from_arguments(args, defaults, flags)
    chosen = load_config(args.config, args.env_config, args.curriculum_config, args.preset,
                         [*defaults, *args.set, *flags], base=saved if continue_run else None,
                         base_source=f"the configuration saved in {checkpoint}")
    # the program's own settings (evaluate's validator defaults, --max-new-tokens) are chosen as explicitly as --set
    named = users_fields(args) | {_field_of(assignment) for assignment in [*defaults, *flags]}
    return _bound_to_checkpoint(chosen, named, saved["train"], checkpoint)


def users_fields(args: argparse.Namespace) -> set[tuple[str, ...]]:
    """The config paths (("train", "model", "name_or_path"), ...) that the user's files, presets and --set name."""
    named: set[tuple[str, ...]] = set()

    def walk(prefix: tuple[str, ...], document: Any) -> None:
        named.add(prefix)
        if isinstance(document, dict):
            for key, value in document.items():
                walk((*prefix, key), value)

    for section, file in (("train", args.config), ("env", args.env_config), ("curriculum", args.curriculum_config)):
        if file:
            walk((section,), json.loads(Path(file).read_text()))
    for name in args.preset:
        for section, part in read_preset(name).items():
            walk((section,), part)
    named.update(_field_of(assignment) for assignment in args.set)
    return named


def _field_of(assignment: str) -> tuple[str, ...]:
    """"ppo.learning_rate=2e-5" -> ("train", "ppo", "learning_rate")."""
    section, keys = override_location(parse_override(assignment)[0])
    return (section, *keys)


def config_for_adapter(args: argparse.Namespace, path: Path | None, defaults: Sequence[str] = (),
                       flags: Sequence[str] = (), adapter_only: bool = False) -> tuple[Config, Path | None]:
    """The configuration and the adapter folder for a program that loads the adapter at `path` (a checkpoint or
    an adapter folder; None: the base model alone). The checkpoint is checked against its manifest and read for
    its model before anything loads; `adapter_only` (a program that reads nothing else of it) needs only the adapter
    and the configuration to verify."""
    if path is None:
        return config_from_arguments(args, defaults, flags), None
    from ppo_affine.checkpoint import checkpoint_holding  # torch: only the programs that read a checkpoint load it
    from ppo_affine.policy import adapter_folder

    # before the adapter is looked for: a corrupt checkpoint names its bad file
    source = checkpoint_holding(path, adapter_only=adapter_only)
    adapter_dir = adapter_folder(path)
    if source is None:
        return config_from_arguments(args, defaults, flags), adapter_dir
    return config_for_checkpoint(args, source, defaults, flags), adapter_dir


def _bound_to_checkpoint(chosen: Config, named: set[tuple[str, ...]], saved_train: dict[str, Any],
                         checkpoint: Path) -> Config:
    train = chosen.train.model_dump(mode="json")
    for field in (*BOUND_TO_CHECKPOINT, *CARRIED_FROM_CHECKPOINT):
        *sections, name = field.split(".")
        saved_section, section = saved_train, train
        for key in sections:
            saved_section, section = saved_section.get(key, {}), section[key]
        if name not in saved_section:  # a checkpoint from before the field existed
            continue
        saved, given = saved_section[name], section[name]
        if given == saved:
            continue
        path = ("train", *sections, name)
        if not any(path[:end] in named for end in range(1, len(path) + 1)):
            section[name] = saved  # the files' default, not the user's choice: the checkpoint's value
        elif field in BOUND_TO_CHECKPOINT:
            raise ConfigError(f"{field}={given!r} conflicts with {checkpoint}, which was trained with {saved!r}: "
                              "leave the setting out (it is read from the checkpoint).")
    _keep_the_server_the_user_chose(train, named)
    try:
        return chosen.model_copy(update={"train": type(chosen.train).model_validate(train)})
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"]
        raise ConfigError(f"The configuration saved in {checkpoint} does not validate: {problem}.") from None


def _keep_the_server_the_user_chose(train: dict[str, Any], named: set[tuple[str, ...]]) -> None:
    """A vLLM server the run started is started again only while the backend is vLLM and the user names no server
    of their own (env.vllm_url): `--set generation.backend=local` or a URL given wins over the checkpoint's."""
    server = train["generation"]["vllm_server"]
    if server["python"] is None or {("train", "generation", "vllm_server", "python"),
                                    ("train", "generation", "vllm_server"), ("train", "generation")} & named:
        return
    if train["generation"]["backend"] != "vllm" or ("env", "vllm_url") in named:
        server["python"] = None
