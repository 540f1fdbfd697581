"""policy.py: LoRA + value head on a tiny local model; reference = adapter off; persistence; learning."""
import contextlib

import pytest
import torch

from ppo_affine.envs.tasks import Task
from ppo_affine.advantages import assign_advantages
from ppo_affine.batching import build_sequences
from ppo_affine.experience import score_sequences
from ppo_affine.policy import adapter_weights_digest, load_policy, resolve_lora_targets
from ppo_affine.rollout import Episode, Turn
from ppo_affine.testing.tiny import activate_adapter
from ppo_affine.update import UpdateSettings, UpdateState, build_optimizer, ppo_update
from ppo_affine.config import ConfigError, LoraConfig, ModelConfig, PPOConfig


def _batch(policy, prompt="<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n", response="3 7"):
    tok = policy.tokenizer
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt_ids + response_ids])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[0, len(prompt_ids):] = 1
    return ids, torch.ones_like(ids), mask


def _one_update(policy, lr=1e-2):
    ids, attention, mask = _batch(policy)
    optimizer = torch.optim.AdamW(policy.adapter_parameters() + list(policy.value_head.parameters()), lr=lr)
    scored = policy.score(ids, attention, mask)
    loss = -(scored.logprobs * mask).sum() + (scored.values ** 2).sum()
    loss.backward()
    optimizer.step()


def test_only_lora_and_value_head_are_trainable(tiny_policy):
    trainable = {n for n, p in tiny_policy.named_parameters() if p.requires_grad}
    assert trainable, "nothing trainable"
    assert all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert {"value_head.weight", "value_head.bias"} <= trainable
    base_before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if not p.requires_grad}
    _one_update(tiny_policy)
    for name, param in tiny_policy.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, base_before[name]), f"base parameter {name} changed"


def test_score_matches_a_plain_forward_pass(tiny_policy):
    ids, attention, mask = _batch(tiny_policy)
    scored = tiny_policy.score(ids, attention, mask)
    logits = tiny_policy.model(input_ids=ids, attention_mask=attention).logits.float()
    expected = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    positions = mask[0].bool()
    assert torch.allclose(scored.logprobs[0, positions], expected[positions[1:]], atol=1e-5)
    assert torch.all(scored.logprobs[0, ~positions] == 0)


def test_score_equals_the_full_logits_of_every_response_token_in_float32(tiny_policy, monkeypatch):
    """The LM head runs per chunk of tokens (here 2): log-probs, entropies and their gradients are those of the whole
    model's logits at the sampling temperature, through the same fp32 log-softmax."""
    import ppo_affine.ppo as ppo

    activate_adapter(tiny_policy.model, 0.5)
    ids, attention, mask = _batch(tiny_policy, response="3 7 and then 12 14")
    positions = mask[0].bool()
    logits = tiny_policy.model(input_ids=ids, attention_mask=attention).logits[0, :-1][positions[1:]] / 0.7
    expected_logprobs, expected_entropy = ppo.logprobs_and_entropy_from_logits(logits[None], ids[:, 1:][:, positions[1:]])
    (expected_logprobs.sum() + expected_entropy.sum()).backward()
    expected_grads = {name: p.grad.clone() for name, p in tiny_policy.model.named_parameters() if p.requires_grad}
    tiny_policy.zero_grad(set_to_none=True)

    monkeypatch.setattr(ppo, "CHUNK_ELEMENTS", 2 * logits.shape[-1])  # two tokens' logits per chunk
    scored = tiny_policy.score(ids, attention, mask, with_entropy=True, temperature=0.7)
    (scored.logprobs.sum() + scored.entropy.sum()).backward()
    assert positions.sum() > 4  # several chunks
    torch.testing.assert_close(scored.logprobs[0, positions], expected_logprobs[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(scored.entropy[0, positions], expected_entropy[0], atol=1e-6, rtol=0)
    # gradients reach ~100 here: float32 sums in another order differ by up to ~1e-6 of the largest one
    scale = max(grad.abs().max().item() for grad in expected_grads.values())
    for name, parameter in tiny_policy.model.named_parameters():
        if parameter.requires_grad:
            assert (parameter.grad - expected_grads[name]).abs().max().item() <= 1e-6 * scale, name


def _rows_sharing_a_prefix(policy):
    """Four right-padded rows: one long shared prompt, then different replies (two rows identical)."""
    tok = policy.tokenizer
    prompt = tok("<|im_start|>system\nYou are playing liars_dice. Bid or call Liar.<|im_end|>\n<|im_start|>user\n"
                 "Your dice: 1 1 2 3 4. Legal actions: 19 -> 4-2, 60 -> Liar<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    replies = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for text in ("60", "19 then more", "60", "Liar")]
    width = len(prompt) + max(len(r) for r in replies)
    ids = torch.full((4, width), tok.pad_token_id)
    mask = torch.zeros(4, width)
    for row, reply in enumerate(replies):
        ids[row, : len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        mask[row, len(prompt): len(prompt) + len(reply)] = 1
    return ids, mask


def _scored_with_gradients(policy, ids, mask):
    policy.zero_grad(set_to_none=True)
    scored = policy.score(ids, None, mask, with_values=True, with_entropy=True)
    ((scored.logprobs * mask).sum() + (scored.values * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return scored, grads


# "past_key_values": the KV cache's name before transformers 5.2x (5.17 has no other), still taken by newer ones
@pytest.mark.parametrize("cache_keyword", [None, "past_key_values"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the old name, on purpose
def test_rows_with_a_common_prefix_score_and_train_as_if_run_whole(tiny_policy, monkeypatch, cache_keyword):
    from ppo_affine import policy as policy_module
    from ppo_affine import prefixes

    if cache_keyword is not None:
        monkeypatch.setattr(policy_module, "kv_cache_keyword", lambda: cache_keyword)

    ids, mask = _rows_sharing_a_prefix(tiny_policy)
    assert policy_module.common_prefix_length(ids) > prefixes.MIN_SHARED_PREFIX
    activate_adapter(tiny_policy, 0.3)  # an adapter that matters, so its gradients through the prefix do
    for module in tiny_policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # as in PPO (ppo.disable_dropout): two passes must see the same network
    tiny_policy.train()
    shared, shared_grads = _scored_with_gradients(tiny_policy, ids, mask)
    monkeypatch.setattr(prefixes, "MIN_SHARED_PREFIX", 10**9)  # every row run whole
    whole, whole_grads = _scored_with_gradients(tiny_policy, ids, mask)
    for name in ("logprobs", "values", "entropy"):
        assert torch.allclose(getattr(shared, name), getattr(whole, name), atol=1e-5), name
    assert shared_grads.keys() == whole_grads.keys() and len(whole_grads) > 4
    for name, grad in whole_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_identical_rows_run_once(tiny_policy, monkeypatch):
    from ppo_affine import policy as policy_module

    ids, mask = _rows_sharing_a_prefix(tiny_policy)
    same, same_mask = ids[[0, 2]], mask[[0, 2]]
    assert policy_module.common_prefix_length(same) == same.shape[1]
    calls = []
    decoder = tiny_policy.model.get_base_model().get_decoder()
    monkeypatch.setattr(decoder, "forward", lambda *a, __f=decoder.forward, **k: calls.append(k["input_ids"].shape)
                        or __f(*a, **k))
    scored = tiny_policy.score(same, None, same_mask, with_values=False)
    assert calls == [(1, same.shape[1])]
    # the head runs on each row of the expanded hidden states: equal up to the last bits of the matmul
    # kernel, which on some CPUs rounds rows of one batch differently
    torch.testing.assert_close(scored.logprobs[0], scored.logprobs[1], rtol=1e-6, atol=1e-6)


def test_reference_equals_base_model_and_differs_after_an_update(tiny_policy, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids, attention, mask = _batch(tiny_policy)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_logits = base(input_ids=ids).logits.float()
    base_logprobs = torch.log_softmax(base_logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    positions = mask[0].bool()

    _one_update(tiny_policy)
    with torch.no_grad():
        policy_lp = tiny_policy.score(ids, attention, mask).logprobs[0, positions]
        with tiny_policy.reference():
            ref_lp = tiny_policy.score(ids, attention, mask, with_values=False).logprobs[0, positions]
    assert torch.allclose(ref_lp, base_logprobs[positions[1:]], atol=1e-5)
    assert (policy_lp - ref_lp).abs().max() > 1e-3


def test_adapter_saved_in_peft_format_loads_with_peft_from_pretrained(tiny_policy, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _one_update(tiny_policy)
    tiny_policy.save(tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not any("value_head" in p.name for p in (tmp_path / "adapter").iterdir()), "value head leaked into adapter"
    ids, attention, _ = _batch(tiny_policy)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, tiny_policy.model(input_ids=ids).logits, atol=1e-5)


def test_load_restores_adapter_and_value_head(tiny_policy, tiny_model_dir, tmp_path):
    _one_update(tiny_policy)
    tiny_policy.save(tmp_path)
    fresh = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), use_4bit=False, dtype="float32",
                                    gradient_checkpointing=False), LoraConfig(), torch.device("cpu"))
    fresh.load(tmp_path)
    ids, attention, mask = _batch(tiny_policy)
    with torch.no_grad():
        a, b = tiny_policy.score(ids, attention, mask), fresh.score(ids, attention, mask)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.values, b.values)


def test_adapter_weights_digest_follows_the_weights_not_the_folder(tiny_policy, tmp_path):
    import shutil

    tiny_policy.save(tmp_path / "before")
    shutil.copytree(tmp_path / "before", tmp_path / "copy")
    (tmp_path / "copy" / "adapter" / "README.md").write_text("base_model: /somewhere/else\n")  # peft's model card
    _one_update(tiny_policy)
    tiny_policy.save(tmp_path / "after")
    before = adapter_weights_digest(tmp_path / "before")
    assert before == adapter_weights_digest(tmp_path / "copy") == adapter_weights_digest(tmp_path / "copy" / "adapter")
    assert adapter_weights_digest(tmp_path / "after") != before
    with pytest.raises(ConfigError, match="neither a checkpoint folder"):
        adapter_weights_digest(tmp_path)
    for weights in (tmp_path / "copy" / "adapter").glob("adapter_model.*"):
        weights.unlink()
    with pytest.raises(ConfigError, match="copy/adapter has no LoRA weights"):
        adapter_weights_digest(tmp_path / "copy")


def test_lora_targets_resolve_against_real_module_names(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert resolve_lora_targets(base, ["q_proj", "nonexistent", "down_proj"]) == ["q_proj", "down_proj"]
    with pytest.raises(ConfigError, match="match no linear layer.*q_proj"):
        resolve_lora_targets(base, ["query_key_value"])


def test_ppo_learns_a_synthetic_first_token_reward(tiny_policy):
    """14 PPO updates with reward 1 when the first generated token is one of a tenth of the
    vocabulary (ids divisible by 10) raise the probability of that set from about 0.1 to above 0.8
    (it passes 0.8 at the 10th and stays about 0.9 from the 11th)."""
    torch.manual_seed(0)
    tok = tiny_policy.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "pick"}], add_generation_prompt=True,
                                         tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    rewarded = list(range(0, len(tok), 10))
    cfg = PPOConfig(learning_rate=1e-2, ppo_epochs=4, batch_size=64, init_kl_coef=0.0, adaptive_kl=False,
                    vf_coef=0.5, micro_batch_tokens=8192, kl_stop=None)
    optimizer = build_optimizer(tiny_policy, cfg, value_lr=1e-2)

    def first_token_probs() -> torch.Tensor:
        with torch.no_grad():
            logits = tiny_policy.model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float()
        return torch.softmax(logits, -1)

    expected_reward_before = float(first_token_probs()[rewarded].sum())
    state = UpdateState()
    for step in range(14):
        firsts = torch.multinomial(first_token_probs(), cfg.batch_size, replacement=True).tolist()
        episodes = [
            Episode(task=Task("synthetic", i, i, None, "s", False), env_kind="synthetic",
                    turns=[Turn([first], "", None, sequence=0, start=len(prompt_ids))],
                    sequences=[prompt_ids + [first]], score=float(first % 10 == 0), done=True)
            for i, first in enumerate(firsts)
        ]
        sequences = build_sequences(episodes)
        score_sequences(tiny_policy, sequences, cfg.micro_batch_tokens, 1.0, with_values=True)
        assign_advantages(sequences, episodes, cfg, kl_coef=0.0, group_ids=None)
        settings = UpdateSettings(cfg, 0.0, 1.0, cfg.micro_batch_tokens, shuffle_seed=step)
        ppo_update(tiny_policy, optimizer, sequences, settings, state)
    expected_reward_after = float(first_token_probs()[rewarded].sum())
    assert 0.03 < expected_reward_before < 0.2
    assert expected_reward_after > 0.8, f"expected reward {expected_reward_before:.3f} -> {expected_reward_after:.3f}"


def test_reference_adapter_is_a_frozen_kl_anchor_that_checkpoints_carry(tiny_policy, tiny_model_dir, tmp_path):
    from ppo_affine.testing.tiny import load_tiny_policy

    ids, attention, mask = _batch(tiny_policy)
    positions = mask[0].bool()

    def logprobs(policy, context=None):
        with torch.no_grad(), (context or contextlib.nullcontext()):
            return policy.score(ids, attention, mask, with_values=False).logprobs[0, positions]

    base = logprobs(tiny_policy, tiny_policy.base())
    _one_update(tiny_policy)  # stands in for SFT
    tiny_policy.save(tmp_path / "sft")
    sft = logprobs(tiny_policy)
    trainable = [n for n, p in tiny_policy.named_parameters() if p.requires_grad]

    tiny_policy.set_reference_adapter(tmp_path / "sft" / "adapter")
    assert [n for n, p in tiny_policy.named_parameters() if p.requires_grad] == trainable
    assert torch.allclose(logprobs(tiny_policy, tiny_policy.reference()), sft, atol=1e-6)
    _one_update(tiny_policy)  # PPO moves the trained adapter only
    assert (logprobs(tiny_policy) - sft).abs().max() > 1e-3
    assert torch.allclose(logprobs(tiny_policy, tiny_policy.reference()), sft, atol=1e-6)
    assert torch.allclose(logprobs(tiny_policy, tiny_policy.base()), base, atol=1e-6)
    assert [n for n, p in tiny_policy.named_parameters() if p.requires_grad] == trainable  # after reference()

    tiny_policy.save(tmp_path / "ppo")
    resumed = load_tiny_policy(tiny_model_dir)
    resumed.load(tmp_path / "ppo")
    assert torch.allclose(logprobs(resumed), logprobs(tiny_policy), atol=1e-6)
    assert torch.allclose(logprobs(resumed, resumed.reference()), sft, atol=1e-6)


def test_the_probe_adapter_moves_the_log_probs_and_puts_the_adapter_back_exactly(tiny_policy):
    from ppo_affine.policy import PROBE_SHIFT

    prompt = tiny_policy.tokenizer.encode("The game begins.", add_special_tokens=False)
    before = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters() if "lora_" in n}
    with tiny_policy.base():
        base = tiny_policy.token_logprobs(prompt, [])
    assert torch.allclose(tiny_policy.token_logprobs(prompt, []), base)  # a fresh adapter (B = 0) moves nothing
    with tiny_policy.probe_adapter(prompt):
        moved = tiny_policy.token_logprobs(prompt, [])
        tokens = moved.topk(3).indices.tolist()
        assert torch.allclose(tiny_policy.token_logprobs(prompt, tokens[:1]), moved[tokens[:1]])
    assert (moved - base).pow(2).mean().sqrt() >= PROBE_SHIFT
    after = {n: p.detach() for n, p in tiny_policy.model.named_parameters() if "lora_" in n}
    assert all(torch.equal(before[n], after[n]) for n in before)
