"""Small local repository tasks for the harness env: a bug, the test that finds it, and the check that scores a
run. Stdlib only: the env imports it in the trainer's Python, the tests in theirs.

Task `t` is one of TASKS (t % len(TASKS)). Reward 1 when the repository's own tests pass after the harness ran,
with the test files put back as they were first (a fix that edits the test does not count), else 0.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RepoTask:
    name: str
    statement: str  # what the harness is told (SWE-INFINITE: the PR description)
    source: dict[str, str]  # path -> text, with the bug
    tests: dict[str, str]  # path -> text, the test that fails until the bug is fixed


TASKS = (
    RepoTask(
        name="calc_add",
        statement="calc.add(2, 3) returns -1, but it must return the sum 5. Fix calc.py.",
        source={"calc.py": "def add(a, b):\n    return a - b\n"},
        tests={"test_calc.py": "import unittest\n\nimport calc\n\n\nclass AddTest(unittest.TestCase):\n"
                               "    def test_add(self):\n        self.assertEqual(calc.add(2, 3), 5)\n"},
    ),
    RepoTask(
        name="words_count",
        statement="words.count('a b  c') returns 4, but it must count the words: 3. Fix words.py.",
        source={"words.py": "def count(text):\n    return len(text.split(' '))\n"},
        tests={"test_words.py": "import unittest\n\nimport words\n\n\nclass CountTest(unittest.TestCase):\n"
                                "    def test_count(self):\n        self.assertEqual(words.count('a b  c'), 3)\n"},
    ),
)


def task_of(task_id: int) -> RepoTask:
    return TASKS[int(task_id) % len(TASKS)]


def make_repo(task: RepoTask, folder: Path) -> Path:
    """The task's repository in `folder` (a git repository with one commit, as the harnesses expect)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in {**task.source, **task.tests}.items():
        (folder / path).write_text(text)
    git = ["git", "-C", str(folder), "-c", "user.name=task", "-c", "user.email=task@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", f"task {task.name}"], check=True)
    return folder


def diff_of(folder: Path) -> str:
    """What the harness changed (the patch SWE-INFINITE takes from a codex run)."""
    subprocess.run(["git", "-C", str(folder), "add", "-A"], check=True)
    return subprocess.run(["git", "-C", str(folder), "diff", "--cached"], check=True, capture_output=True,
                          text=True).stdout


def tests_pass(task: RepoTask, folder: Path) -> bool:
    """The task's tests, restored to their original text, pass on the repository as the harness left it."""
    for path, text in task.tests.items():
        (folder / path).write_text(text)
    result = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=folder, capture_output=True, text=True,
                            timeout=60)
    return result.returncode == 0
