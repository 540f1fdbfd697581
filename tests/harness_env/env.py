"""A SWE-INFINITE-like env for the tests: evaluate() runs a real coding harness (mini-swe-agent or codex, as
SWE-INFINITE configures them) against the model's OpenAI-compatible endpoint on a small local repository task
(repo_task.py), and scores 1 when the task's tests pass. Served by affinetes' own template server (serve.py).

Where the harnesses are: MINISWE_PYTHON, the Python of a virtual environment with mini-swe-agent 1.x (the
harness's pinned clients never enter the caller's); CODEX_BIN, the codex 0.94.0 binary or the npm package's
bin/codex.js. What a run scores, as SWE-INFINITE scores it: miniswe, 1 only when the agent submitted and the tests
pass (a run that never submits scores 0); codex, 1 when its turn completed with a change and the tests pass. A run
that failed for another reason than the model (run_outcome.py) is returned as an `error`: not scored.
"""
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import repo_task  # noqa: E402
from codex_run import run_codex_turn, write_codex_home  # noqa: E402
from run_outcome import INFRA_FAILURE, codex_outcome, miniswe_outcome  # noqa: E402

HERE = Path(__file__).resolve().parent


def harness_path(variable: str) -> str:
    """Where a harness is, from the server's environment; a clear error when it was not told."""
    path = os.environ.get(variable)
    if not path:
        raise RuntimeError(f"{variable} is not set: start this env's server with it (see this file's docstring)")
    return path


def codex_prompt(task) -> str:
    return (f"You are fixing a bug in the repository in the current directory.\n\n## Issue\n\n{task.statement}\n\n"
            "## Instructions\n\n- Change only source files; do not edit the tests.\n"
            "- Read the relevant files first, make the smallest change, then stop.")


class Actor:
    async def evaluate(self, task_id=0, seed=None, model="m", base_url="http://127.0.0.1/v1", api_key=None,
                       temperature=0.0, timeout=600, agent="miniswe", max_iterations=50):
        task = repo_task.task_of(task_id)
        work = Path(tempfile.mkdtemp(prefix=f"harness-{agent}-"))
        try:
            repo = repo_task.make_repo(task, work / "repo")
            if agent == "miniswe":
                outcome = await asyncio.to_thread(self._miniswe, task, repo, work, model, base_url, api_key,
                                                  temperature, seed, max_iterations, timeout)
            elif agent == "codex":
                outcome = await asyncio.to_thread(self._codex, task, repo, work, model, base_url, api_key, timeout)
            else:
                return {"task_name": f"harness:{agent}", "score": 0.0, "error": f"unknown agent {agent!r}"}
            if "error" in outcome or outcome["outcome"] == INFRA_FAILURE:  # not scored, as SWE-INFINITE does
                return {"task_name": f"harness:{agent}:{task.name}", "score": 0.0,
                        "error": outcome.get("error") or f"{agent}: {outcome['harness_error']}", "extra": outcome}
            passed = outcome.pop("finished") and repo_task.tests_pass(task, repo)
            return {"task_name": f"harness:{agent}:{task.name}", "score": 1.0 if passed else 0.0, "success": passed,
                    "extra": outcome}
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _miniswe(task, repo, work, model, base_url, api_key, temperature, seed, max_iterations, timeout) -> dict:
        spec = {"repo": str(repo), "statement": task.statement, "model": model, "base_url": base_url,
                "api_key": api_key or "EMPTY", "temperature": temperature, "seed": seed,
                "step_limit": max_iterations}
        (work / "spec.json").write_text(json.dumps(spec))
        python = harness_path("MINISWE_PYTHON")
        process = subprocess.run([python, str(HERE / "miniswe_run.py"), str(work / "spec.json"),
                                  str(work / "result.json")], capture_output=True, text=True, timeout=timeout,
                                 env={**os.environ, "MSWEA_SILENT_STARTUP": "1"})
        if not (work / "result.json").exists():  # the harness itself broke: not the model's fault, no score
            return {"error": f"mini-swe-agent exited {process.returncode}: {process.stderr[-2000:]}"}
        result = json.loads((work / "result.json").read_text())
        return {"finished": result["exit_status"] == "Submitted", "exit_status": result["exit_status"],
                "outcome": miniswe_outcome(result["error"]), "harness_error": result["error"],
                "model_calls": result["model_calls"], "patch": result["submission"],
                "conversation": result["conversation"]}

    @staticmethod
    def _codex(task, repo, work, model, base_url, api_key, timeout) -> dict:
        home = write_codex_home(work / "codex-home", model, base_url)
        turn = run_codex_turn(harness_path("CODEX_BIN"), home, repo, model, codex_prompt(task), api_key, timeout)
        if turn.error is not None:
            return {"error": f"codex: {turn.error}; stderr: {turn.stderr[-1500:]}"}
        patch = repo_task.diff_of(repo)
        errors = turn.errors()
        return {"finished": turn.status == "completed" and bool(patch), "exit_status": turn.status,
                "outcome": codex_outcome(turn.status, errors),
                "harness_error": json.dumps(errors[-1]) if errors else None, "patch": patch,
                "conversation": [event["params"].get("item") for event in turn.events
                                 if event.get("method") == "item/completed"]}
