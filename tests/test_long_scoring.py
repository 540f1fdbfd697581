"""Scoring a long episode at the admitted models' real vocabulary (248 320) without full logits: the LM head runs per
chunk of tokens and again in backward, so the logits' memory is one chunk's whatever the episode's length.

Memory is torch's count of tensor bytes alive at once (`LiveBytes`, what CUDA's max_memory_allocated counts) over one
forward and backward of `Policy.score`, on the tiny `qwen3_5_moe` language model (Gated DeltaNet, full attention,
routed experts) with LoRA. The logits' share is the peak of the pass that scores log-probs minus the peak of the same
pass with values only (the trunk and value head, no LM head)."""
import pytest
import torch

from ppo_affine.testing.live_bytes import LiveBytes

VOCABULARY = 248320  # Qwen3.5/3.6's
pytestmark = pytest.mark.slow  # the LM head over 8 k tokens x 248 k, forward, again and backward: minutes on a CPU


@pytest.fixture(scope="module")
def long_policy():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppo_affine.architectures import default_lora_targets
    from ppo_affine.policy import Policy, resolve_lora_targets
    from ppo_affine.testing.tiny import tiny_architecture_config

    torch.manual_seed(0)
    config = tiny_architecture_config("qwen3_5_moe_text", VOCABULARY, pad_token_id=0, eos_token_id=1)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    targets = resolve_lora_targets(base, default_lora_targets(config), explicit=False)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    return Policy(model, tokenizer=None).train()


def _peak_of_one_backward(policy, tokens: int, with_logprobs: bool) -> int:
    """Bytes alive at the peak of one scoring pass over a `tokens`-token reply and its backward."""
    ids = torch.randint(0, VOCABULARY, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    live = LiveBytes()
    with live.mode:
        scored = policy.score(ids, None, torch.ones_like(ids), with_values=True, with_logprobs=with_logprobs)
        loss = scored.values.sum() + (scored.logprobs.sum() if with_logprobs else 0)
        loss.backward()
        del scored, loss
    policy.zero_grad(set_to_none=True)
    return live.peak


def test_one_backward_over_3072_tokens_stays_under_3_gb(long_policy):
    weights = sum(p.numel() * p.element_size() for p in long_policy.parameters())
    peak = weights + _peak_of_one_backward(long_policy, 3072, with_logprobs=True)
    # the whole logits alone would be 3072 x 248320 x 4 B = 3.05 GB, and log-softmax's fp32 copies as much again
    assert peak < 3e9, f"{peak / 1e9:.2f} GB"


def test_the_logits_share_of_memory_does_not_grow_with_the_episode(long_policy):
    share = {tokens: _peak_of_one_backward(long_policy, tokens, with_logprobs=True)
             - _peak_of_one_backward(long_policy, tokens, with_logprobs=False) for tokens in (2048, 8192)}
    # one chunk of 135 tokens' logits (2^25 / 248320 rows) and its temporaries, ~0.57 GB at either length; the full
    # logits would grow from 2.0 to 8.1 GB
    assert share[8192] == pytest.approx(share[2048], rel=0.10), {k: v / 1e9 for k, v in share.items()}
    assert share[2048] < 1e9
