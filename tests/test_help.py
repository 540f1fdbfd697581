"""Every program explains every option: a help text, its default shown where it has one, the presets listed."""
import argparse
import importlib

import pytest

PROGRAMS = ["train_ppo", "evaluate", "sft_warmstart", "merge", "visualize", "prepare_model"]


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
