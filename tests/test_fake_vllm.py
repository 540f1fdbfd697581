"""ppo_affine/testing/fake_vllm.py, in process: the stand-in for vLLM answers the calls the trainer makes the
way vLLM documents them (the slow tests run it as a server process)."""
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from ppo_affine.testing import fake_vllm


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    return TestClient(fake_vllm.build_app(str(tiny_model_dir), served_name="tiny", max_model_len=256))


def test_models_name_the_served_model_and_its_context(server, tiny_model_dir):
    assert server.get("/v1/models").json()["data"] == [
        {"id": "tiny", "object": "model", "root": str(tiny_model_dir), "max_model_len": 256}]


def test_a_greedy_completion_returns_the_models_own_tokens_as_ids_with_their_logprobs(server, tiny_model_dir):
    prompt = [5, 6, 7, 8]
    reply = server.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                 "temperature": 0, "logprobs": 0,
                                                 "return_tokens_as_token_ids": True}).json()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{int(logp.argmax())}"]
    assert logprobs["token_logprobs"] == pytest.approx([float(logp.max())], abs=1e-5)


def test_an_unknown_model_name_is_a_404(server):
    assert server.post("/v1/completions", json={"model": "other", "prompt": [5]}).status_code == 404


def test_without_runtime_lora_updating_the_adapter_endpoints_do_not_exist(tiny_model_dir):
    server = TestClient(fake_vllm.build_app(str(tiny_model_dir), runtime_lora=False))
    assert server.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404


@pytest.mark.parametrize("mode,scale", [("raw_logprobs", 1.0), ("processed_logprobs", 2.0)])
def test_log_probs_are_the_models_or_the_tempered_ones_as_vllms_logprobs_mode_says(tiny_model_dir, mode, scale):
    """At temperature 0.5 tempering doubles every gap between two log-probs; raw log-probs keep it."""
    server = TestClient(fake_vllm.build_app(str(tiny_model_dir), served_name="tiny", logprobs_mode=mode))
    prompt = [5, 6, 7, 8]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    reply = server.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.5,
                                                 "logprobs": 3, "return_tokens_as_token_ids": True}).json()
    [top] = reply["choices"][0]["logprobs"]["top_logprobs"]
    best, *rest = [int(t) for t in logp.topk(3).indices]
    assert {f"token_id:{best}", *(f"token_id:{t}" for t in rest)} <= set(top.keys())
    for other in rest:
        gap = top[f"token_id:{best}"] - top[f"token_id:{other}"]
        assert gap == pytest.approx(scale * float(logp[best] - logp[other]), rel=1e-4)


def test_stop_strings_end_a_reply_at_the_token_that_completes_one(tiny_policy):
    from ppo_affine.testing.fake_vllm import _cut_at_stop_string

    tokenizer = tiny_policy.tokenizer
    tokens = tokenizer.encode("ab```cd```ef", add_special_tokens=False)
    logprobs = list(range(len(tokens)))
    cut, kept, finish, reason = _cut_at_stop_string(tokenizer, tokens, logprobs, "length", ["```"])
    assert tokenizer.decode(cut).count("```") == 1 and tokenizer.decode(cut[:-1]).count("```") == 0
    assert kept == logprobs[:len(cut)] and (finish, reason) == ("stop", "```")
    assert _cut_at_stop_string(tokenizer, tokens, logprobs, "length", []) == (tokens, logprobs, "length", None)
