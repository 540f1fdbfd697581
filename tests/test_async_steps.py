"""async_steps: 1, the next step's rollout during this step's update (train_ppo.Trainer.step_overlapped): the
settings it refuses, the adapter versions and the steps-behind bookkeeping, the correction of stale replies, and exact
resume after kill -9 or SIGTERM with a rollout in flight, against a fake vLLM server that samples with the adapters."""
import math
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from ppo_affine.batching import TrainSequence
from ppo_affine.config import ConfigError, load_config
from ppo_affine.experience import correct_for_the_sampler
from ppo_affine.rollout import Episode, Turn
from ppo_affine.run_log import steps_behind
from ppo_affine.envs.tasks import Task
from test_train import ROOT_ON_PATH, deterministic, metrics, served_adapters, tiny_args


# ---------------------------------------------------------------------- settings
def test_async_steps_with_local_generation_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="async_steps=1 overlaps a vLLM server's generation") as error:
        load_config(presets=["cpu"], overrides=["async_steps=1"])
    assert "\n" not in str(error.value)


def test_async_steps_switch_the_sampler_correction_on_and_refuse_it_switched_off():
    cfg = load_config(presets=["cpu"], overrides=["generation.backend=vllm", "async_steps=1"]).train
    assert cfg.async_steps == 1 and cfg.ppo.sampler_correction
    with pytest.raises(ConfigError, match="leave it on"):
        load_config(presets=["cpu"], overrides=["generation.backend=vllm", "async_steps=1",
                                                "ppo.sampler_correction=false"])


def test_async_steps_refuse_several_ranks():
    cfg = load_config(presets=["cpu"], overrides=["generation.backend=vllm", "async_steps=1", "ppo.batch_size=4"]).train
    with pytest.raises(ConfigError, match="runs in one process"):
        train_ppo.check_can_train(cfg, world_size=2)


# ---------------------------------------------------------------------- bookkeeping and the correction
def _episode(*adapter_steps):
    task = Task(env="openspiel", task_id=1, seed=0, opponent="random", stage="s", replay=False)
    turns = [Turn(response_ids=[1], response_text="1", sampler_logprobs=[-1.0], adapter_step=step)
             for step in adapter_steps]
    return Episode(task=task, env_kind="openspiel", turns=turns)


def test_steps_behind_counts_updates_between_the_writing_adapter_and_the_policy():
    # the policy has had 3 updates; replies written by the adapters of steps 2, 2, 1 and 3
    behind = steps_behind([_episode(2, 2), _episode(1, 3)], policy_step=3)
    assert behind == {"async/steps_behind_mean": pytest.approx((1 + 1 + 2 + 0) / 4), "async/steps_behind_max": 2.0}
    assert steps_behind([_episode(None, None)], policy_step=3) == {}  # the trainer sampled them: nothing is stale


def test_the_correction_weighs_stale_replies_by_hand_computed_truncated_ratios():
    # the trainer's old log-probs (policy after step k) against the stale sampler's (adapter of step k-1)
    sequence = TrainSequence(episode=0, input_ids=[5, 6, 7, 8], spans=[(1, 4)], turns=[0],
                             sampler_logprobs=[-1.2, -1.0, float("nan")])
    sequence.old_logprobs = torch.tensor([-1.0, -2.0, -0.5])
    stats = correct_for_the_sampler([sequence], cap=1.1)
    # exp(-1.0 + 1.2) = 1.2214 capped at 1.1; exp(-2.0 + 1.0) = 0.3679; a position without a sampler log-prob: 1
    assert sequence.importance_weights.tolist() == pytest.approx([1.1, math.exp(-1.0), 1.0], abs=1e-6)
    assert stats["tis/weight_mean"] == pytest.approx((1.1 + math.exp(-1.0)) / 2, abs=1e-6)
    assert stats["tis/clip_fraction"] == pytest.approx(0.5)


# ---------------------------------------------------------------------- the loop, through a fake vLLM server
def async_args(model_dir, out, url, name, *extra):
    """A tiny async run named `name` (its adapters' names start with it) in `out`/`name`."""
    return tiny_args(model_dir, out, "--set", "generation.backend=vllm", "--set", f"env.vllm_url={url}",
                     "--set", "async_steps=1", "--set", "ppo.learning_rate=1e-2", "--set", "generation.max_turns=3",
                     "--set", "checkpointing.save_every=1", "--set", "ppo.ppo_epochs=1", "--set", f"run.name={name}",
                     *extra)


def adapter_weights(run, step):
    return load_file(str(run / "checkpoints" / f"checkpoint-{step}" / "adapter" / "adapter_model.safetensors"))


def assert_same_run(straight, resumed, steps):
    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        x, y = deterministic(x), deterministic(y)
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-6), key
    wa, wb = adapter_weights(straight, steps), adapter_weights(resumed, steps)
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)


# Stops the run at a chosen point of step 2 (counted from 1): "update" inside its update (the rollout of step 3 in
# flight), "rollout" inside the rollout of step 3 once step 2's update has finished. It writes the marker file there,
# then waits for a signal, checking for a stop request as the update does.
STALL_SCRIPT = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    import train_ppo
    from ppo_affine.rollout import RolloutRunner
    marker, where = Path({marker!r}), {where!r}
    score_and_update = train_ppo.Trainer.score_and_update
    def stalling_update(self, episodes, group_ids):
        if where == "update" and self.step == 1:
            marker.write_text("update")
            while True:
                time.sleep(0.05)
                self.check_stop()
        return score_and_update(self, episodes, group_ids)
    train_ppo.Trainer.score_and_update = stalling_update
    play = RolloutRunner.play
    async def stalling_play(self, index, task, step):
        if where == "rollout" and step == 2:
            while not Path(str(marker) + ".updated").exists():
                await asyncio.sleep(0.05)
            marker.write_text("rollout")
            await asyncio.sleep(600)
        return await play(self, index, task, step)
    RolloutRunner.play = stalling_play
    push = train_ppo.Trainer.push_adapter
    async def noting_push(self, step, activate=True):
        await push(self, step, activate)
        if step == 2:
            Path(str(marker) + ".updated").write_text("")
    train_ppo.Trainer.push_adapter = noting_push
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


def unload_leftovers(url, prefix):
    """Unload the adapters a killed run (its name `prefix`) left on the shared server; a run that exits unloads its
    own."""
    import httpx

    for name in served_adapters(url):
        if name.startswith(prefix):
            httpx.post(f"{url[: -len('/v1')]}/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()


def start_stalled(tmp_path, args, where):
    """`args` run in a process that stalls at `where` in step 2; returns the process and its marker file."""
    marker = tmp_path / f"marker-{where}"
    script = tmp_path / f"stall_{where}.py"
    script.write_text(STALL_SCRIPT.format(marker=str(marker), where=where))
    log = open(tmp_path / f"stall_{where}.log", "w+")  # a file: a pipe nobody reads meanwhile could fill and block
    process = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.DEVNULL, stderr=log,
                               env=ROOT_ON_PATH)
    process.log = log
    return process, marker


def signal_when_stalled(process, marker, sig):
    """Send `sig` once the process has stalled; returns its exit code."""
    deadline = time.time() + 300
    while not marker.exists():
        if process.poll() is not None:
            process.log.seek(0)
            pytest.fail(f"the run stopped before {marker.name}: {process.log.read()[-3000:]}")
        assert time.time() < deadline, f"the run never reached {marker.name}"
        time.sleep(0.1)
    process.send_signal(sig)
    return process.wait(timeout=120)


@pytest.mark.slow
def test_async_steps_overlap_resume_exactly_after_kill_and_sigterm_mid_step(tiny_model_dir, tmp_path, fake_vllm):
    steps = 3
    runs = {name: tmp_path / name / name for name in ("straight", "killed", "stopped")}
    args = {name: async_args(tiny_model_dir, run.parent, fake_vllm, name, "--max-steps", str(steps))
            for name, run in runs.items()}
    # kill -9 inside step 2's update, with step 3's rollout in flight; SIGTERM inside step 3's rollout once step 2's
    # update has finished. Both start first and stall while the straight run goes (they share the server).
    killing = start_stalled(tmp_path, args["killed"], "update")
    stopping = start_stalled(tmp_path, args["stopped"], "rollout")
    try:
        assert train_ppo.main(args["straight"]) == 0
        killed_code = signal_when_stalled(*killing, signal.SIGKILL)
        stopped_code = signal_when_stalled(*stopping, signal.SIGTERM)
    finally:
        for process, _ in (killing, stopping):
            process.kill()
            process.wait()
            process.log.close()
        unload_leftovers(fake_vllm, "killed-")

    records = metrics(runs["straight"])
    assert [r["step"] for r in records] == [1, 2, 3]
    # step 1 trains on the initial adapter's replies; from step 2 on, on those of the adapter one update behind
    assert [r["async/steps_behind_mean"] for r in records] == [0.0, 1.0, 1.0]
    reported = 0  # the curriculum hears of each step's episodes once, in that step, before the next draw
    for record in records:
        reported += record["env/episodes"] - record["env/episodes_cut_off"] - record["env/episodes_failed"]
        assert record["curriculum/stage_episodes"] + record["curriculum/replayed"] == reported
    for record in records:
        assert 0 < record["tis/weight_mean"] and 0 <= record["tis/clip_fraction"] <= 1
        assert "policy/loss" in record and record["perf/wait_for_rollout_seconds"] >= 0
    # the stale replies were sampled by another adapter than the one scored: the gap shows it
    assert records[1]["vllm/logprob_gap"] > 10 * records[0]["vllm/logprob_gap"]
    # every adapter it loaded (staged ones too) is unloaded at exit
    assert not [name for name in served_adapters(fake_vllm) if name.startswith("straight-")]
    checkpoints = runs["straight"] / "checkpoints"
    state = torch.load(checkpoints / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert len(state["pending"]["episodes"]) == 4  # step 3's episodes, played during step 2's update
    assert all(t.adapter_step == 1 for e in state["pending"]["episodes"] for t in e.turns)
    assert torch.load(checkpoints / "checkpoint-3" / "trainer_state.pt",
                      weights_only=False)["pending"] is None  # the last step plays nothing ahead

    # the killed run resumes from checkpoint 1 to the straight run
    assert killed_code == -signal.SIGKILL
    assert train_ppo.main(args["killed"] + ["--resume", "latest"]) == 0
    assert_same_run(runs["straight"], runs["killed"], steps)

    # the stopped run undid its whole step 2 and saved step 1 (with step 2's episodes); it resumes to the straight run
    assert stopped_code == 128 + signal.SIGTERM
    assert [r["step"] for r in metrics(runs["stopped"])] == [1]
    assert not (runs["stopped"] / "checkpoints" / "checkpoint-2").exists()
    assert train_ppo.main(args["stopped"] + ["--resume", "latest"]) == 0
    assert_same_run(runs["straight"], runs["stopped"], steps)


@pytest.mark.slow  # uses the session's fake vLLM server
def test_a_server_that_lost_its_adapters_gets_the_active_and_the_staged_one_back(tiny_policy, fake_vllm, tmp_path):
    import asyncio

    import httpx

    from ppo_affine.config import GenerationConfig
    from ppo_affine.envs.base import EpisodeLost
    from ppo_affine.generation import VLLMGenerator
    from test_train import fake_vllm_model

    tiny_policy.save(tmp_path)
    root = fake_vllm[: -len("/v1")]
    assert served_adapters(fake_vllm) == []  # every run before unloaded what it loaded

    async def outage_with_an_adapter_staged():
        generator = VLLMGenerator(fake_vllm, fake_vllm_model(fake_vllm), tiny_policy.tokenizer,
                                  GenerationConfig(max_new_tokens=2, request_retries=0), 16, {0})
        try:
            active = await generator.load_adapter(tmp_path / "adapter", "run-step-1", step=1)
            staged = await generator.load_adapter(tmp_path / "adapter", "run-step-2", step=2, activate=False)
            assert sorted(served_adapters(fake_vllm)) == sorted([active, staged])  # staging unloads nothing in use
            assert (await generator.generate([1, 2, 3], 0, seed=0)).adapter_step == 1
            for name in (active, staged):  # as a restarted server: every adapter gone
                httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
            with pytest.raises(EpisodeLost):  # the episode is replayed, once both are back
                await generator.generate([1, 2, 3], 0, seed=0)
            assert sorted(served_adapters(fake_vllm)) == sorted([active, staged])
            await generator.activate_staged()
            assert served_adapters(fake_vllm) == [staged]  # the one before is retired
            return (await generator.generate([1, 2, 3], 0, seed=0)).adapter_step
        finally:
            await generator.close()

    assert asyncio.run(outage_with_an_adapter_staged()) == 2
    assert served_adapters(fake_vllm) == []
