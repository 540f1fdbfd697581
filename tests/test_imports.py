"""Importing any program or engine module prints nothing: a library's notice at import would reach every
user of every program. Run the way a user runs them, with Python's default warning filters. The engine
imports alone: from outside the checkout, where the programs at its root cannot be found."""
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = ["train_ppo", "evaluate", "sft_warmstart", "merge", "prepare_model", "visualize", "curriculum", "utils",
            "verdict"]
ENGINE = """
import importlib, pkgutil
import ppo_affine
for module in pkgutil.walk_packages(ppo_affine.__path__, "ppo_affine."):
    importlib.import_module(module.name)
import sys
assert not {"utils", "curriculum", "train_ppo"} & set(sys.modules), "the engine imported a program-side module"
import bitsandbytes, peft, transformers  # what the policy imports when it loads a model
"""


ROOT = Path(__file__).resolve().parent.parent


def imported_output(code: str, cwd: Path | str = "/") -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS)
def test_a_program_imports_without_a_line_of_output(program):
    assert imported_output(f"import {program}", cwd=ROOT) == ""  # programs run from the checkout's root


@pytest.mark.slow
def test_every_engine_module_and_bitsandbytes_import_without_a_line_of_output():
    assert imported_output(ENGINE) == ""


@pytest.mark.parametrize("program_side", ["utils", "curriculum"])
def test_the_install_puts_no_program_module_into_site_packages(program_side):
    """Outside the checkout only the engine package is importable: a top-level `utils` of ours would clash."""
    done = subprocess.run([sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec('{program_side}'))"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.stdout.strip() == "None"
