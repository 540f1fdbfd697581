"""The anchor for envs not being trained (ppo_affine/anchor.py): its KL estimator, the recorded episodes it reads and
splits, its gradient on a tiny model, its settings, and the loop: a metric per anchored env each step, the held-out
KL at checkpoints, an exact resume, and a bad file named in one line before the model loads."""
import json
import math

import pytest
import torch

import train_ppo
from ppo_affine.anchor import AnchorTraining, anchor_kl, read_anchor_episodes, split_held_out
from ppo_affine.checkpoint import load_trainer_state
from ppo_affine.config import AnchorConfig, ConfigError, load_config
from ppo_affine.distill.render import render_rollout
from ppo_affine.testing.distill_cells import golden_cells, write_cells
from test_train import deterministic, metrics, straight_and_resumed, tiny_args


def episode(game: str, replies: list[str]) -> dict:
    """An evaluate.py episodes.jsonl record with a reply per turn."""
    conversation = [{"role": "system", "content": f"You are playing {game}."}]
    for turn, reply in enumerate(replies):
        conversation += [{"role": "user", "content": f"Turn {turn}. Legal actions: 0, 1, 2"},
                         {"role": "assistant", "content": reply}]
    return {"model": "base", "env": "openspiel", "game": game, "task_id": 7, "seed": 1, "score": 0.5,
            "conversation": conversation}


def write_episodes(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def episodes_file(tmp_path):
    records = [episode("liars_dice", ["1", "0 then 2"]), episode("liars_dice", ["2"]),
               episode("liars_dice", ["0", "1"]), episode("liars_dice", ["2 2"]),
               episode("trace", ["42"]), episode("trace", ["x = 3"]),
               {**episode("trace", []), "error": "cut off"}]  # no reply: nothing to anchor
    return write_episodes(tmp_path / "episodes.jsonl", records)


def test_the_anchor_kl_is_r_minus_1_minus_log_r_of_the_policy_over_the_reference():
    logprobs = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.4)])
    reference = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.4)])
    # r = 2: 2 - 1 - ln 2; r = 1/2: 1/2 - 1 + ln 2; r = 1: 0
    assert anchor_kl(logprobs, reference).tolist() == pytest.approx([0.306853, 0.193147, 0.0], abs=1e-6)


def test_episodes_are_read_by_game_and_the_last_of_each_are_held_out(episodes_file):
    episodes = read_anchor_episodes("anchor.episodes", episodes_file)
    assert [e.env for e in episodes] == ["liars_dice"] * 4 + ["trace"] * 2  # the episode without a reply is left out
    assert episodes[0].where.endswith("episodes.jsonl:1") and episodes[0].messages[2].content == "1"
    anchored, held_out = split_held_out(episodes, 0.25)
    # liars_dice: ceil(0.25 * 4) = 1 held out; trace: ceil(0.25 * 2) = 1
    assert [e.where[-1] for e in anchored["liars_dice"]] == ["1", "2", "3"]
    assert [e.where[-1] for e in held_out["liars_dice"]] == ["4"]
    assert [e.where[-1] for e in anchored["trace"]] == ["5"] and [e.where[-1] for e in held_out["trace"]] == ["6"]
    anchored, held_out = split_held_out(episodes, 0.0)
    assert len(anchored["liars_dice"]) == 4 and held_out["liars_dice"] == []


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{not json\n", "episodes.jsonl:1 is not a recorded episode"),
    ('{"game": "x", "conversation": [{"role": "user", "content": "hi"}]}\n', "holds no episode with a reply"),
    ('{"conversation": [{"role": "assistant", "content": "1"}]}\n', "episodes.jsonl:1 is not a recorded episode"),
])
def test_an_unreadable_episodes_file_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "episodes.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as caught:
        read_anchor_episodes("anchor.episodes", path)
    assert "anchor.episodes: " in str(caught.value) and str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_share_that_holds_out_every_episode_of_an_env_is_refused(tmp_path):
    path = write_episodes(tmp_path / "one.jsonl", [episode("liars_dice", ["1"])])
    with pytest.raises(ConfigError, match="holds out every one of env liars_dice's 1 episodes"):
        AnchorTraining(AnchorConfig(episodes=[path], held_out_share=0.5), seed=0)


@pytest.mark.parametrize("sets,message", [
    (["anchor.coef=0"], "greater than 0"),
    (["anchor.per_step=0"], "greater than or equal to 1"),
    (["anchor.held_out_share=1"], "less than 1"),
    (['anchor.episodes=["/e.jsonl"]', "ppo.disable_dropout=false"], "keep ppo.disable_dropout=true"),
    (['anchor.episodes=["/e.jsonl"]', "async_steps=1", "generation.backend=vllm"], "set async_steps=0 to use anchor"),
])
def test_anchor_settings_that_cannot_work_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(presets=["cpu"], overrides=sets)


def independent_anchor_loss(policy, records, coef):
    """coef * the mean over the episodes' reply tokens of r - 1 - log r, from the model's own logits."""
    terms = []
    for record in records:
        from ppo_affine.anchor import _message
        rendered = render_rollout([_message(m) for m in record["conversation"]], policy.tokenizer)
        ids = torch.tensor([rendered.input_ids])
        targets = ids[0, 1:]
        at = torch.tensor(rendered.loss_mask[1:]).bool()

        def logprobs():
            return torch.log_softmax(policy.model(input_ids=ids).logits[0, :-1].float(), -1).gather(
                -1, targets[:, None])[:, 0][at]

        with torch.no_grad(), policy.base():
            reference = logprobs()
        ratio = torch.exp(logprobs() - reference)
        terms.append(ratio - 1 - torch.log(ratio))
    return coef * torch.cat(terms).mean()


def test_the_anchor_gradient_is_zero_at_the_reference_and_autograd_of_its_loss_after(tiny_policy, tmp_path):
    records = [episode("liars_dice", ["1", "0 then 2"]), episode("liars_dice", ["2 1"])]
    settings = AnchorConfig(episodes=[write_episodes(tmp_path / "e.jsonl", records)], coef=2.0, per_step=2,
                            held_out_share=0.0)
    anchor = AnchorTraining(settings, seed=0)
    lora = [p for n, p in tiny_policy.named_parameters() if p.requires_grad and "lora_" in n]
    tiny_policy.eval()
    got = anchor.accumulate(tiny_policy)  # a fresh LoRA (B = 0) is the reference: r = 1 at every token
    assert got["anchor/liars_dice/kl"] == 0.0 and got["anchor/liars_dice/tokens"] > 0
    assert all(p.grad is None or not p.grad.any() for p in lora)

    torch.manual_seed(3)
    with torch.no_grad():
        for p in lora:
            p.add_(0.2 * torch.randn_like(p))
    tiny_policy.zero_grad(set_to_none=True)
    got = anchor.accumulate(tiny_policy)
    ours = [p.grad.clone() for p in lora]
    tiny_policy.zero_grad(set_to_none=True)
    expected = independent_anchor_loss(tiny_policy, records, coef=2.0)
    expected.backward()
    assert got["anchor/liars_dice/kl"] == pytest.approx(expected.item() / 2.0, rel=1e-5)
    assert got["anchor/liars_dice/kl"] > 1e-4
    for mine, theirs in zip(ours, (p.grad for p in lora)):  # float32 sums in another order: to 0.1 % of the largest
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3 * theirs.abs().max().item())


def test_an_anchor_file_that_cannot_be_read_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_model(*_, **__):
        raise AssertionError("the model was loaded before the anchor's episodes were read")

    monkeypatch.setattr(train_ppo, "load_policy", no_model)
    missing = tmp_path / "nowhere.jsonl"
    code = train_ppo.main(["--preset", "cpu", "--output-dir", str(tmp_path), "--set", "generation.backend=local",
                           "--set", f'anchor.episodes=["{missing}"]'])
    assert code == 2
    err = capsys.readouterr().err
    assert f"anchor.episodes: cannot read {missing}" in err


@pytest.fixture(scope="module")
def loop_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchor-loop")
    cells = golden_cells()
    records = [episode("liars_dice", [str(i % 3), "1"]) for i in range(5)] + [episode("trace", ["7"])] * 2
    return (write_cells(root / "train", [cells[0], cells[2], cells[3]]),
            write_episodes(root / "episodes.jsonl", records))


def anchor_args(tiny_model_dir, out, loop_files, *extra):
    cells, episodes = loop_files
    return tiny_args(tiny_model_dir, out, "--set", f"distill.cells={cells}", "--set", "distill.cells_per_step=2",
                     "--set", "distill.max_seq_len=512", "--set", f'anchor.episodes=["{episodes}"]',
                     "--set", "anchor.per_step=2", "--set", "anchor.coef=2.0", "--set", "anchor.held_out_share=0.4",
                     *extra)


@pytest.mark.slow
def test_the_anchor_in_the_cells_step_logs_each_env_and_resumes_exactly(tiny_model_dir, tmp_path, loop_files):
    only = ("--set", "distill.only=true", "--set", "checkpointing.save_every=2", "--set", "ppo.learning_rate=0.01")
    straight, split = straight_and_resumed(lambda out, *more: anchor_args(tiny_model_dir, out, loop_files, *more),
                                           tmp_path, *only)
    a, b = metrics(straight), metrics(split)
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]  # the same draws, the same numbers
    for record in a:  # liars_dice: 3 anchored, 2 held out (ceil(0.4 * 5)); trace: 1 and 1
        assert record["anchor/liars_dice/tokens"] > 0 and record["anchor/trace/tokens"] > 0
        assert "anchor/grad_norm" not in record  # the anchor is a term of the cells' step, not a step of its own
    assert a[0]["anchor/liars_dice/kl"] == 0 and a[-1]["anchor/liars_dice/kl"] > 0  # the adapter moved
    assert [sorted(k for k in r if k.endswith("held_out_kl")) for r in a] == \
        [[], ["anchor/liars_dice/held_out_kl", "anchor/trace/held_out_kl"]] * 2  # at the checkpoints
    state = load_trainer_state(straight / "checkpoints" / "checkpoint-4")
    assert state["anchor"]["draws"]


@pytest.mark.slow
def test_the_anchor_beside_ppo_alone_takes_a_step_of_its_own_after_the_update(tiny_model_dir, tmp_path, loop_files):
    _, episodes = loop_files
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1", "--set",
                                    f'anchor.episodes=["{episodes}"]')) == 0
    [record] = metrics(tmp_path / "t")
    assert record["env/episodes"] == 4 and "policy/loss" in record
    assert record["anchor/liars_dice/kl"] > 0  # after PPO's update moved the adapter
    assert "anchor/grad_norm" in record and "anchor/trace/held_out_kl" in record  # the last step saves
