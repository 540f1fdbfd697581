"""Every program explains every option: a help text, its default shown where it has one, the presets listed."""
import argparse
import importlib

import pytest

PROGRAMS = ["train_ppo", "evaluate", "sft_warmstart", "merge", "visualize", "prepare_model", "verdict"]


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(program: str, monkeypatch) -> argparse.ArgumentParser:
    def capture(parser, *args, **kwargs):
        raise Captured(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Captured) as captured:
        importlib.import_module(program).parse_args([])
    return captured.value.parser


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_option_has_a_help_text_and_a_whole_description(program, monkeypatch):
    parser = parser_of(program, monkeypatch)
    silent = [action.option_strings[0] for action in parser._actions if action.option_strings and not action.help]
    assert silent == []
    assert parser.description.endswith(".")  # the docstring's whole first paragraph, never cut mid-sentence


def test_defaults_and_presets_show_in_the_help(monkeypatch, capsys):
    parser = parser_of("sft_warmstart", monkeypatch)
    text = " ".join(parser.format_help().split())
    assert "--epochs EPOCHS" in text and "(default: " in text
    parser = parser_of("train_ppo", monkeypatch)
    text = " ".join(parser.format_help().split())
    assert "cpu" in text and "warm_start" in text and "trace" in text  # the presets by name


def option_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help as --help prints it (defaults filled in), by its first name."""
    formatter = parser._get_formatter()
    return {action.option_strings[0]: formatter._expand_help(action) if action.help else ""
            for action in parser._actions if action.option_strings and action.dest != "help"}


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_option_states_its_default_or_what_happens_without_it(program, monkeypatch):
    """A default is shown ('off' for a flag, 'none' for a repeatable option), or the help says what leaving the
    option out does ('default: ...' in its own words), or the option is required."""
    helps = option_helps(parser_of(program, monkeypatch))
    silent = {name: text for name, text in helps.items() if "(default" not in text and "required" not in text}
    assert silent == {}
    assert [name for name, text in helps.items() if "(default: )" in text] == []  # an empty default says nothing


def test_a_flag_an_empty_text_and_a_repeatable_option_show_their_defaults(monkeypatch):
    helps = option_helps(parser_of("sft_warmstart", monkeypatch))
    assert helps["--relabel-missed-only"].endswith("(default: off)")
    assert helps["--expert"].endswith("(default: none)") and helps["--reason"].endswith("(default: none)")
    assert helps["--set"].endswith("(default: none)")
