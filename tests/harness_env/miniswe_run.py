"""One mini-swe-agent 1.x run as SWE-INFINITE sets it up, in the harness's own Python (never the trainer's):
`python miniswe_run.py SPEC.json RESULT.json`.

What is SWE-INFINITE's (affinetes environments/SWE-INFINITE/agents/miniswe.py and config.yaml, read for facts):
DefaultAgent in text mode with a THOUGHT + exactly one bash block per reply, a `<think>` section dropped before the
block is looked for, the observation as `<returncode>`/`<output>` with outputs over 10 000 characters cut to their
first and last 5 000, the format error naming how many blocks it found, `step_limit` = max_iterations, cost limit 3,
the litellm model `openai/<model>` with the temperature and seed passed and cost errors ignored, no retry on a 4xx
(it ends the run), submitting with `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached`.
What is ours: the prompts' wording (shorter), and the commands run in bubblewrap on the task's folder with no
network instead of in the task's Docker container.
"""
import json
import re
import subprocess
import sys

import litellm
from minisweagent.agents.default import DefaultAgent, FormatError
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"
TEMPLATES = {
    "system_template": (
        "You solve programming tasks by running shell commands, one per reply.\n"
        "Each reply has a THOUGHT section, then exactly ONE bash code block holding ONE command "
        "(join several with && or ||):\n\nTHOUGHT: why this command\n\n```bash\nthe_command\n```\n"),
    "instance_template": (
        "<pr_description>\n{{task}}\n</pr_description>\n\n"
        "Change the source files in the current directory so that the description holds. Do not edit the tests. "
        "Every command runs in a new subshell. When you are done, submit with this command alone "
        "(you cannot work on the task after it):\n\n```bash\n" + SUBMIT + "\n```\n"),
    "action_observation_template": (
        "<returncode>{{output.returncode}}</returncode>\n"
        "{% if output.output | length < 10000 -%}\n<output>\n{{ output.output -}}\n</output>\n"
        "{%- else -%}\n<warning>The output was too long; look at less of it (head, tail, sed -n).</warning>\n"
        "<output_head>\n{{ output.output[:5000] }}\n</output_head>\n"
        "<elided_chars>\n{{ output.output | length - 10000 }} characters elided\n</elided_chars>\n"
        "<output_tail>\n{{ output.output[-5000:] }}\n</output_tail>\n{%- endif -%}"),
    "format_error_template": (
        "Reply with EXACTLY ONE action in a ```bash block; found {{actions|length}} actions.\n"
        "When the task is done, submit as the first message says.\n"),
}
ENV = {"PAGER": "cat", "MANPAGER": "cat", "LESS": "-R", "PIP_PROGRESS_BAR": "off", "TQDM_DISABLE": "1"}


class OneTryModel(LitellmModel):
    """A 4xx from the server (context overflow, limits) ends the run at once, as SWE-INFINITE's model does; the
    5xx retries it keeps are left out (the tests' endpoint answers or refuses)."""

    def _query(self, messages, **kwargs):
        return litellm.completion(model=self.config.model_name, messages=messages,
                                  **(self.config.model_kwargs | kwargs))


class ThinkingAwareAgent(DefaultAgent):
    def parse_action(self, response: dict) -> dict:
        content = response["content"]
        if "</think>" in content:
            content = content.split("</think>")[-1].strip()
        actions = re.findall(self.config.action_regex, content, re.DOTALL)
        if len(actions) == 1:
            return {"action": actions[0].strip(), **response}
        raise FormatError(self.render_template(self.config.format_error_template, actions=actions))


class BubblewrapEnvironment(LocalEnvironment):
    """Each command in bubblewrap: the system read-only, the task's folder writable, a private /tmp, no network."""

    def execute(self, command: str, cwd: str = "", *, timeout: int | None = None):
        folder = cwd or self.config.cwd
        jail = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                "--bind", folder, folder, "--chdir", folder, "--unshare-all", "--die-with-parent",
                "bash", "-c", command]
        result = subprocess.run(jail, text=True, env={**ENV, "PATH": "/usr/local/bin:/usr/bin:/bin",
                                                      "HOME": "/tmp"},
                                timeout=timeout or self.config.timeout, encoding="utf-8", errors="replace",
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return {"output": result.stdout, "returncode": result.returncode}


def run(spec: dict) -> dict:
    model_kwargs = {"temperature": spec["temperature"], "api_base": spec["base_url"], "api_key": spec["api_key"]}
    if spec.get("seed") is not None:
        model_kwargs["seed"] = spec["seed"]
    model = OneTryModel(model_name=f"openai/{spec['model']}", model_kwargs=model_kwargs, cost_tracking="ignore_errors")
    env = BubblewrapEnvironment(cwd=spec["repo"], timeout=spec.get("command_timeout", 60))
    agent = ThinkingAwareAgent(model, env, **TEMPLATES, step_limit=spec["step_limit"], cost_limit=3.0)
    exit_status, submission, error = None, "", None
    try:
        exit_status, result = agent.run(spec["statement"])
        submission = result if exit_status == "Submitted" else ""
    except Exception as exc:  # a 4xx, a lost server: the run ends here, as SWE-INFINITE's does
        error = f"{type(exc).__name__}: {exc}"
    conversation = [{"role": m["role"], "content": m["content"]} for m in agent.messages]
    return {"exit_status": exit_status, "submission": submission, "error": error, "model_calls": model.n_calls,
            "conversation": conversation}


if __name__ == "__main__":
    with open(sys.argv[1]) as spec_file:
        outcome = run(json.load(spec_file))
    with open(sys.argv[2], "w") as result_file:
        json.dump(outcome, result_file)
