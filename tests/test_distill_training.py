"""Training on DISTILL-V2 cells inside the real loop (train_ppo.py): the offline mode (`distill.only`), cells beside
PPO episodes, the held-out score at checkpoints, an exact resume, and bad cells named in one line."""
import json

import pytest

import train_ppo
from ppo_affine.checkpoint import load_trainer_state
from ppo_affine.testing.distill_cells import golden_cells, write_cells
from test_train import deterministic, metrics, straight_and_resumed, tiny_args


@pytest.fixture(scope="module")
def cell_folders(tmp_path_factory):
    """Training cells (two of 3-4 rollouts with a reward spread, one silent: every reward equal) and held-out cells
    (another task), tiny-model sized. A cell of two rollouts would teach nothing: its score is +-tanh(1) whichever
    way the NLLs differ (tau is their half-gap), so its gradient is 0."""
    cells = golden_cells()
    root = tmp_path_factory.mktemp("distill-cells")
    return (write_cells(root / "train", [cells[0], cells[2], cells[3]]),
            write_cells(root / "held-out", [cells[1]]))


def cell_args(tiny_model_dir, out, cell_folders, *extra):
    train, held_out = cell_folders
    return tiny_args(tiny_model_dir, out, "--set", f"distill.cells={train}", "--set",
                     f"distill.held_out_cells={held_out}", "--set", "distill.cells_per_step=2",
                     "--set", "distill.max_seq_len=512", *extra)


@pytest.mark.slow
def test_the_offline_mode_trains_on_cells_alone_and_resumes_exactly(tiny_model_dir, tmp_path, cell_folders):
    only = ("--set", "distill.only=true", "--set", "distill.kl_coef=0.1", "--set", "checkpointing.save_every=2")
    straight, split = straight_and_resumed(lambda out, *more: cell_args(tiny_model_dir, out, cell_folders, *more),
                                           tmp_path, *only)
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]  # the same cells drawn, the same numbers
    for record in a:
        assert record["distill/cells"] == 2 and record["distill/loss_tokens"] > 0
        assert not any(key.startswith(("env/", "policy/")) for key in record)  # no episode was played
    assert [("distill/held_out_score" in r) for r in a] == [False, True, False, True]  # at the checkpoints
    assert a[0]["distill/kl_per_token"] == 0 and a[-1]["distill/kl_per_token"] > 0  # the adapter moved off its reference
    assert any(r["distill/grad_norm"] > 1e-3 for r in a)
    state = load_trainer_state(straight / "checkpoints" / "checkpoint-4")
    assert state["distill"]["draws"]


@pytest.mark.slow
def test_cells_beside_ppo_take_a_step_of_their_own_after_the_update(tiny_model_dir, tmp_path, cell_folders):
    assert train_ppo.main(cell_args(tiny_model_dir, tmp_path, cell_folders, "--max-steps", "1")) == 0
    [record] = metrics(tmp_path / "t")
    assert record["env/episodes"] == 4 and "policy/loss" in record
    assert record["distill/cells"] == 2 and "distill/grad_norm" in record
    assert "distill/held_out_score" in record  # the last step saves


def test_cells_that_cannot_be_read_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_model(*_, **__):
        raise AssertionError("the model was loaded before the cells were read")

    monkeypatch.setattr(train_ppo, "load_policy", no_model)
    code = train_ppo.main(["--preset", "cpu", "--output-dir", str(tmp_path), "--set", "generation.backend=local",
                           "--set", f"distill.cells={tmp_path / 'nowhere'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "distill.cells " in err and "nowhere is neither an http(s) URL nor a folder" in err


@pytest.mark.parametrize("sets,message", [
    (["distill.only=true"], "distill.only trains on cells alone: set distill.cells"),
    (["distill.cells=/c", "distill.held_out_cells=/c"], "a held-out score needs cells never trained on"),
    (["distill.cells=/c", "ppo.disable_dropout=false"], "keep ppo.disable_dropout=true"),
])
def test_distill_settings_that_cannot_work_are_refused(sets, message):
    from ppo_affine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(presets=["cpu"], overrides=sets)
