"""Data-parallel training over torch.distributed: gloo ranks on the CPU, started by torchrun."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from test_train import _free_port, deterministic, metrics, tiny_args

import train_ppo
from ppo_affine.checkpoint import find_resumable, load_trainer_state, verify
from ppo_affine.distributed import OutOfMemoryOnRanks, Ranks, check_world_size, rng_state_of
from ppo_affine.testing import fake_vllm as fake_vllm_server
from ppo_affine.config import ConfigError, PPOConfig

ROOT = Path(__file__).resolve().parent.parent


def torchrun(*args: str, ranks: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N ARGS` (gloo on this CPU machine), from the repository root."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment["PYTHONPATH"] = str(ROOT)  # the rank scripts import the programs at the checkout's root
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment)


def as_rank(rank: int, world_size: int) -> Ranks:
    return Ranks(rank=rank, world_size=world_size)


# ---------------------------------------------------------------- who plays and trains what
def test_each_of_two_ranks_plays_a_contiguous_half_of_the_batch():
    assert [as_rank(r, 2).share(8) for r in (0, 1)] == [range(0, 4), range(4, 8)]


def test_a_share_is_cut_between_groups():
    # 3 groups of 2 usable episodes over 2 ranks: one group, then two
    assert [as_rank(r, 2).share(6, unit=2) for r in (0, 1)] == [range(0, 2), range(2, 6)]


def test_with_fewer_episodes_than_ranks_a_rank_gets_none():
    assert [as_rank(r, 2).share(1) for r in (0, 1)] == [range(0, 0), range(0, 1)]


def test_rank_zero_keeps_the_run_seed_and_other_ranks_get_their_own():
    assert as_rank(0, 2).seed(7) == 7
    assert as_rank(1, 2).seed(7) not in (7, as_rank(2, 3).seed(7))


def test_a_rank_resumes_its_own_rng_state_and_a_new_rank_keeps_its_seeded_one():
    saved = [{"rank": 0}, {"rank": 1}]
    assert rng_state_of(as_rank(1, 2), saved) == {"rank": 1}
    assert rng_state_of(as_rank(0, 1), {"python": "one process"}) == {"python": "one process"}  # older checkpoints
    assert rng_state_of(as_rank(2, 4), saved) is None


def test_out_of_memory_in_work_every_rank_agrees_on_is_raised_naming_the_rank():
    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert as_rank(0, 1).agree_on_memory(lambda: 7) == 7
    with pytest.raises(OutOfMemoryOnRanks, match="CUDA ran out of memory on rank 0") as raised:
        as_rank(0, 1).agree_on_memory(out_of_memory)
    assert raised.value.ranks == [0] and isinstance(raised.value, torch.cuda.OutOfMemoryError)


# ---------------------------------------------------------------- bad input stops at start
def test_a_world_size_that_does_not_divide_the_batch_names_the_field():
    with pytest.raises(ConfigError, match=r"ppo.batch_size=6 .* 4 ranks"):
        check_world_size(PPOConfig(batch_size=6), 4)


def test_groups_that_would_straddle_two_ranks_name_both_fields():
    with pytest.raises(ConfigError, match=r"ppo.batch_size=4 .*ppo.group_size=4 .*multiple of 8"):
        check_world_size(PPOConfig(batch_size=4, advantage="group", group_size=4), 2)


@pytest.mark.parametrize("world_size,sets,fields", [
    ("4", ["ppo.batch_size=6"], ["ppo.batch_size=6", "4 ranks"]),
    ("2", ["ppo.batch_size=4", "ppo.advantage=group", "ppo.group_size=4"], ["ppo.batch_size", "ppo.group_size"]),
])
def test_a_bad_world_size_stops_every_rank_at_start_with_one_line(world_size, sets, fields):
    for rank in (0, 1):  # every rank stops before it would wait for the others; rank 0 says why
        result = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--preset", "cpu",
                                 *[arg for s in sets for arg in ("--set", s)]], capture_output=True, text=True,
                                timeout=120, cwd=ROOT,
                                env={**os.environ, "WORLD_SIZE": world_size, "RANK": str(rank), "LOCAL_RANK": "0"})
        assert result.returncode == 2 and "Traceback" not in result.stderr
        message = result.stderr.strip()
        if rank == 0:
            assert len(message.splitlines()) == 1 and all(field in message for field in fields), message
        else:
            assert message == ""


# ---------------------------------------------------------------- the same update as one process
@pytest.fixture
def one_thread():
    """torchrun gives each rank one thread; the one-process reference runs the same way, so the two differ
    only by how the ranks split the sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_ranks_of_two_episodes_update_like_one_process_of_four(tiny_model_dir, tmp_path, one_thread):
    from dist_learn import CASES, LEARNING_RATE, learn_once

    result = torchrun(str(ROOT / "tests" / "dist_learn.py"), str(tiny_model_dir), str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    for case in CASES:
        alone = learn_once(tiny_model_dir, tmp_path / f"alone-{case}", case)
        rank0, rank1 = (torch.load(tmp_path / f"{case}-rank{r}.pt", weights_only=False) for r in (0, 1))
        # Adam moves a weight by about lr·m/(√v+ε) per step. Where a weight's gradient sums to rounding noise (a
        # mean |m| near 1e-9 against a typical 3e-5, below ε = 1e-8), its step follows the noise, and the two ways of
        # adding the same terms can send it either way: up to lr per step (seen: 3 of 16 417 weights, 1e-4 apart).
        # Every other weight agrees to 1e-4, and only a handful may be noise-led
        noise_bound, noise_led = alone["optimizer_steps"] * LEARNING_RATE, 0
        for name, weight in alone["weights"].items():
            assert torch.equal(rank0["weights"][name], rank1["weights"][name]), f"{case}: ranks differ on {name}"
            gap = (rank0["weights"][name] - weight).abs()
            apart = gap > 1e-4
            assert not bool((apart & (alone["moments"][name].abs() > 1e-7)).any()), f"{case}: {name}"
            assert float(gap.max()) <= noise_bound, f"{case}: {name}"
            noise_led += int(apart.sum())
        assert noise_led <= 8, f"{case}: {noise_led} weights apart"
        moved = max(float(w.abs().max()) for n, w in alone["weights"].items() if "lora_B" in n or "value_head" in n)
        assert moved > 1e-2, f"{case}: the step barely moved the weights, so the comparison proves little"
        # the same losses and pre-clip gradient norm: a mean over ranks instead of a sum would halve the norm. The
        # policy loss alone sums terms of both signs (advantages ±) to a few 1e-3, so float32 rounding of the larger
        # terms shows at 1e-7 absolute, and how much depends on the CPU's vector width (AVX-512: 1.1e-7, 'group')
        for key in ("policy/loss", "value/loss", "update/grad_norm", "reward/kl_per_token", "policy/entropy"):
            if key in alone["metrics"]:
                tolerance = 1e-6 if key == "policy/loss" else 1e-7
                assert rank0["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-5, abs=tolerance), (
                    case, key)
        assert rank0["kl_coef"] == pytest.approx(alone["kl_coef"], rel=1e-9)
        if case == "stripped":  # two ranks scoring trees end where one process scoring each sequence whole does
            per_turn = learn_once(tiny_model_dir, tmp_path / "alone-stripped_per_turn", "stripped_per_turn")
            # the same losses and gradient norm to 1e-5; the weights after two Adam steps at lr 1e-2 differ by up
            # to about 1e-3 where a gradient is near 0 (Adam moves each weight by about lr whatever its size)
            for name, weight in per_turn["weights"].items():
                assert torch.allclose(rank0["weights"][name], weight, rtol=0, atol=2e-3), f"trees: {name}"
            for key in ("policy/loss", "value/loss", "update/grad_norm", "reward/kl_per_token", "policy/entropy"):
                assert rank0["metrics"][key] == pytest.approx(per_turn["metrics"][key], rel=1e-5, abs=1e-6), key
            assert alone["metrics"]["perf/tokens_processed"] < per_turn["metrics"]["perf/tokens_processed"]
        if case == "gae":  # the update-signal check correlates every rank's replies
            assert rank0["metrics"]["signal/advantage_logprob_corr"] == pytest.approx(
                alone["metrics"]["signal/advantage_logprob_corr"], abs=1e-4)


# ---------------------------------------------------------------- the real loop on two ranks
@pytest.mark.slow
def test_a_two_rank_run_resumes_on_one_rank_and_the_other_way_round(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "--set", "checkpointing.save_every=1")
    result = torchrun(str(ROOT / "train_ppo.py"), *args, "--max-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = tmp_path / "t" / "checkpoints"
    assert len(load_trainer_state(checkpoints / "checkpoint-2")["rng"]) == 2  # each rank's RNG state
    assert train_ppo.main(args + ["--max-steps", "3", "--resume", "latest"]) == 0
    result = torchrun(str(ROOT / "train_ppo.py"), *args, "--max-steps", "4", "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["dist/world_size"] for r in records] == [2, 2, 1, 2]
    assert [r["env/episodes"] for r in records] == [4, 4, 4, 4]  # the global batch, whatever the ranks
    assert [r["totals/episodes"] for r in records] == [4, 8, 12, 16]
    assert all("policy/loss" in r for r in records)
    assert find_resumable(checkpoints).name == "checkpoint-4"


CRASH_RANK_ONE = textwrap.dedent("""
    import os, sys
    import train_ppo
    learn = train_ppo.Trainer.learn_with_oom_retry
    def learn_or_crash(self, episodes, group_ids):
        if self.step == 1 and self.ranks.rank == 1:
            raise MemoryError("rank 1 ran out of memory (simulated)")
        return learn(self, episodes, group_ids)
    train_ppo.Trainer.learn_with_oom_retry = learn_or_crash
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_crashed_rank_stops_the_run_with_a_message_and_the_last_checkpoint_intact(tiny_model_dir, tmp_path):
    script = tmp_path / "crash_rank_one.py"
    script.write_text(CRASH_RANK_ONE)
    result = torchrun(str(script), *tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3",
                                               "--set", "checkpointing.save_every=1"))
    assert result.returncode != 0
    assert "MemoryError: rank 1 ran out of memory (simulated)" in result.stdout + result.stderr  # its own report
    assert "Stopped: rank 0 lost contact with another rank" in result.stderr  # and rank 0's, instead of a hang
    assert "--resume latest" in result.stderr
    checkpoints = tmp_path / "t" / "checkpoints"
    assert find_resumable(checkpoints).name == "checkpoint-1" and verify(checkpoints / "checkpoint-1")
    assert [r["step"] for r in metrics(tmp_path / "t")] == [1]


# Runs train_ppo with CUDA's out-of-memory error raised by rank 1's first micro-batch of the update (rank 0's passes
# go through); every rank writes the token budget of each update it starts to budgets-rank<r>.txt.
OUT_OF_MEMORY_ON_RANK_ONE = textwrap.dedent("""
    import os, sys
    import torch
    import train_ppo
    from ppo_affine import update
    rank = int(os.environ["RANK"])
    micro_batch_loss, ppo_update, calls = update.micro_batch_loss, train_ppo.ppo_update, []
    def out_of_memory_once_on_rank_one(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
        return micro_batch_loss(*args, **kwargs)
    def recording(policy, optimizer, sequences, cfg, *args, **kwargs):
        with open(os.path.join({out!r}, f"budgets-rank{{rank}}.txt"), "a") as budgets:
            budgets.write(f"{{cfg.micro_batch_tokens}}\\n")
        return ppo_update(policy, optimizer, sequences, cfg, *args, **kwargs)
    update.micro_batch_loss = out_of_memory_once_on_rank_one
    train_ppo.ppo_update = recording
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_out_of_memory_on_one_rank_halves_the_token_budget_on_every_rank_and_retries_the_step(tiny_model_dir,
                                                                                               tmp_path):
    script = tmp_path / "out_of_memory_on_rank_one.py"
    script.write_text(OUT_OF_MEMORY_ON_RANK_ONE.format(out=str(tmp_path)))
    retried, halved_from_the_start = tmp_path / "retried", tmp_path / "halved"
    result = torchrun(str(script), *tiny_args(tiny_model_dir, retried, "--max-steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CUDA out of memory in step 1 on rank 1: ppo.micro_batch_tokens halved to 8192" in " ".join(
        result.stdout.split())  # a warning, on standard output with the run's other lines
    # the failed try, its retry, then step 2 keeps the halved budget: on both ranks
    for rank in (0, 1):
        assert (tmp_path / f"budgets-rank{rank}.txt").read_text().split() == ["16384", "8192", "8192"]
    records = metrics(retried / "t")
    assert [(r["step"], r["train/micro_batch_tokens"], r["train/oom_retries"]) for r in records] == \
        [(1, 8192, 1), (2, 8192, 0)]
    # the retried step is the step a run with the halved budget from the start takes
    result = torchrun(str(ROOT / "train_ppo.py"), *tiny_args(tiny_model_dir, halved_from_the_start, "--max-steps", "2",
                                                             "--set", "ppo.micro_batch_tokens=8192"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = metrics(halved_from_the_start / "t")
    assert [deterministic(r) | {"train/oom_retries": 0} for r in records] == [deterministic(r) for r in expected]
    adapter = "t/checkpoints/checkpoint-2/adapter/adapter_model.safetensors"
    got, want = load_file(str(retried / adapter)), load_file(str(halved_from_the_start / adapter))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


AGREEMENT = textwrap.dedent("""
    import sys
    import torch
    from ppo_affine.distributed import Ranks
    ranks = Ranks.from_environment()
    ranks.start(torch.device("cpu"), timeout_minutes=1)
    def fail_on_rank_one():
        if ranks.rank == 1:
            raise ConnectionError("env server 10.0.0.2:8765 refused the connection")
    def fail_on_rank_zero():
        raise OSError("No space left on device")
    # one file per rank: two ranks printing to one shared stdout can interleave their lines
    with open(f"{out}/rank{{ranks.rank}}.txt", "w") as report:
        for attempt in (lambda: ranks.all_succeed(fail_on_rank_one), lambda: ranks.from_main(fail_on_rank_zero)):
            try:
                attempt()
            except Exception as exc:
                report.write(f"rank {{ranks.rank}}: {{type(exc).__name__}}: {{exc}}\\n")
    ranks.close()
""")


@pytest.mark.slow
def test_a_failure_on_one_rank_is_raised_on_every_rank_instead_of_a_hang(tmp_path):
    script = tmp_path / "agreement.py"
    script.write_text(AGREEMENT.format(out=str(tmp_path)))
    result = torchrun(str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = set((tmp_path / "rank0.txt").read_text().splitlines() + (tmp_path / "rank1.txt").read_text().splitlines())
    assert {"rank 1: ConnectionError: env server 10.0.0.2:8765 refused the connection",
            "rank 0: RankFailed: rank 1 failed: ConnectionError: env server 10.0.0.2:8765 refused the connection",
            "rank 0: OSError: No space left on device",
            "rank 1: RankFailed: rank 0 failed: OSError: No space left on device"} == lines


@pytest.mark.slow
def test_unreachable_vllm_servers_stop_every_rank_at_start(tiny_model_dir, tmp_path):
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    args = tiny_args(tiny_model_dir, tmp_path, "--set", "generation.backend=vllm", "--set", f'env.vllm_url=["{dead}"]')
    result = torchrun(str(ROOT / "train_ppo.py"), *args, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count(f"Stopped: The vLLM server at {dead} is not reachable") == 1  # said once, by rank 0
    assert "lost contact" not in result.stderr  # every rank stopped on its own, none was left waiting


@contextlib.contextmanager
def fake_vllm_servers(model_dir: Path, count: int):
    """`count` fake vLLM servers (ppo_affine/testing/fake_vllm.py) on free ports; yields their /v1 URLs."""
    ports = [_free_port() for _ in range(count)]
    processes = []
    try:
        with ThreadPoolExecutor(count) as pool:  # started side by side: each takes seconds to load the model
            starting = [pool.submit(fake_vllm_server.start, model_dir, port) for port in ports]
        processes += [future.result() for future in starting if future.exception() is None]
        for future in starting:
            future.result()  # a server that did not start fails the test once the others are there to stop
        yield [f"http://127.0.0.1:{port}/v1" for port in ports]
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


@pytest.mark.slow
def test_two_ranks_spread_episodes_over_two_vllm_servers_that_each_load_every_adapter_once(tiny_model_dir, tmp_path):
    with fake_vllm_servers(tiny_model_dir, 2) as urls:
        result = torchrun(str(ROOT / "train_ppo.py"), *tiny_args(
            tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "generation.backend=vllm",
            "--set", f"env.vllm_url={json.dumps(urls)}", "--set", "ppo.learning_rate=1e-2"))
        assert result.returncode == 0, result.stderr[-3000:]
        served = [httpx.get(url.removesuffix("/v1") + "/test/stats").json() for url in urls]
    # episodes 0 and 2 of each step asked the first server, 1 and 3 the second, whichever rank played them
    assert all(stats["completions"] > 0 for stats in served)
    # rank 0 loaded the start-up probe adapter, then each adapter once per server (the initial one, then one per
    # update), not once per rank
    assert [stats["loaded"][0].split("-")[:2] for stats in served] == [["adapter", "probe"]] * 2
    assert [[name.split("-step-")[1].split("-")[0] for name in stats["loaded"][1:]] for stats in served] == \
        [["0", "1", "2"], ["0", "1", "2"]]
    records = metrics(tmp_path / "t")
    assert [r["dist/world_size"] for r in records] == [2, 2]
    # every server sampled with the adapter just trained: the trainer's log-probs match the servers'
    assert all(r["vllm/logprob_gap"] < 1e-3 for r in records)
