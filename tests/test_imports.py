"""Importing any program or engine module prints nothing: a library's notice at import would reach every
user of every program. Run the way a user runs them, with Python's default warning filters."""
import subprocess
import sys

import pytest

PROGRAMS = ["train_ppo", "evaluate", "sft_warmstart", "merge", "prepare_model", "visualize", "curriculum", "utils"]
ENGINE = """
import importlib, pkgutil
import ppo_affine
for module in pkgutil.walk_packages(ppo_affine.__path__, "ppo_affine."):
    importlib.import_module(module.name)
import bitsandbytes, peft, transformers  # what the policy imports when it loads a model
"""


def imported_output(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS)
def test_a_program_imports_without_a_line_of_output(program):
    assert imported_output(f"import {program}") == ""


@pytest.mark.slow
def test_every_engine_module_and_bitsandbytes_import_without_a_line_of_output():
    assert imported_output(ENGINE) == ""
