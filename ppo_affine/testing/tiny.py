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


def save_checkpoint_with_active_adapter(model_dir: Path, folder: Path) -> Path:
    """A checkpoint folder (adapter/ + value_head.pt) whose LoRA B matrices are non-zero, so the adapter matters."""
    import torch

    policy = load_tiny_policy(model_dir)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    policy.save(folder)
    return folder
