"""generation.py: per-episode KV cache reuse, every EOS id stops a reply, vLLM token ids kept exactly."""
import asyncio
import json

import httpx
import pytest
import torch
from torch.overrides import TorchFunctionMode

from ppo_affine.generation import VLLMGenerator, eos_token_ids
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from test_rollout import CountingEnv, _tasks
from ppo_affine.config import GenerationConfig


def play(policy, reuse: bool, temperature: float, strategy: str = "full"):
    cfg = GenerationConfig(backend="local", max_new_tokens=5, max_concurrent_episodes=3, context_strategy=strategy,
                           reuse_kv_cache=reuse, temperature=temperature)
    generator = LocalGenerator(policy, cfg, seed=0)
    runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, generator, PromptBuilder(policy.tokenizer, 4096),
                           cfg)
    episodes = asyncio.run(runner.run(_tasks(5), step=0))
    return [[t.response_ids for t in e.turns] for e in episodes], generator


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["full", "last"])
def test_reusing_each_episodes_kv_cache_changes_nothing_but_the_prefill(tiny_policy, temperature, strategy):
    with_cache, reused = play(tiny_policy, True, temperature, strategy)
    without, fresh = play(tiny_policy, False, temperature, strategy)
    assert with_cache == without
    assert fresh.prefilled_tokens == fresh.prompt_tokens
    assert reused.prefilled_tokens < 0.8 * reused.prompt_tokens  # later turns only prefill what is new


def test_full_context_episodes_are_one_token_sequence(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=4, context_strategy="full")
    runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, LocalGenerator(tiny_policy, cfg, seed=0),
                           PromptBuilder(tiny_policy.tokenizer, 4096), cfg)
    episode = asyncio.run(runner.run(_tasks(1), step=0))[0]
    assert len(episode.sequences) == 1 and [t.sequence for t in episode.turns] == [0, 0]
    sequence = episode.sequences[0]
    for turn in episode.turns:  # each reply sits in the sequence exactly where its prompt ended
        assert sequence[turn.start: turn.start + len(turn.response_ids)] == turn.response_ids


def replies(generator: LocalGenerator, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
    """Each prompt's reply from the local generator, all asked at once within one rollout."""
    async def ask():
        async with generator.rollout(step=0):
            asked = [generator.generate(p, order_key=i, seed=(seeds or [0] * len(prompts))[i])
                     for i, p in enumerate(prompts)]
            answers = await asyncio.gather(*asked)
        await generator.close()
        return [a.token_ids for a in answers]
    return asyncio.run(ask())


def test_every_eos_id_of_the_generation_config_ends_a_reply(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=4, temperature=0.0, reuse_kv_cache=False)
    prompt = PromptBuilder(tiny_policy.tokenizer, 4096).encode([{"role": "user", "content": "go"}])
    first_token = replies(LocalGenerator(tiny_policy, cfg, seed=0), [prompt])[0][0]
    config = tiny_policy.model.generation_config
    original = config.eos_token_id
    config.eos_token_id = [tiny_policy.tokenizer.eos_token_id, first_token]
    try:
        generator = LocalGenerator(tiny_policy, cfg, seed=0)
        assert first_token in generator.eos_ids
        assert replies(generator, [prompt]) == [[first_token]]
    finally:
        config.eos_token_id = original


def test_eos_ids_come_from_tokenizer_and_generation_config(tiny_policy):
    class Config:
        eos_token_id = [5, 9]

    assert eos_token_ids(tiny_policy.tokenizer, Config()) == {tiny_policy.tokenizer.eos_token_id, 5, 9}
    assert eos_token_ids(tiny_policy.tokenizer, None) == {tiny_policy.tokenizer.eos_token_id}


def test_vllm_generator_keeps_the_sampled_ids_and_never_adds_an_eos(tiny_policy):
    requests = []

    def serve(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        # stopped by a stop string: the last token is not an EOS and must stay that way
        return httpx.Response(200, json={"choices": [{"finish_reason": "stop", "text": "x", "logprobs": {
            "tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.5, None]}}]})

    generator = VLLMGenerator("http://vllm/v1", "base", tiny_policy.tokenizer, GenerationConfig(), 8, {2, 3})
    generator.client = httpx.AsyncClient(transport=httpx.MockTransport(serve))
    generation = asyncio.run(generator.generate([1, 2], order_key=0, seed=5))
    assert generation.token_ids == [11, 12]
    assert generation.logprobs[0] == -0.5 and generation.logprobs[1] != generation.logprobs[1]  # NaN
    assert requests[0]["stop_token_ids"] == [2, 3] and requests[0]["prompt"] == [1, 2]


class RulesEnv(CountingEnv):
    """CountingEnv with a long system prompt: every episode's first prompt is the same."""

    async def reset(self, task_id=None, seed=None, **kwargs):
        result = await super().reset(task_id, seed, **kwargs)
        result["info"]["system_prompt"] = "Rules: " + " ".join(f"card {i} beats card {i + 1}." for i in range(30))
        return result


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_first_prompts_that_begin_alike_are_prefilled_once(tiny_policy, temperature):
    def rollout(reuse: bool):
        cfg = GenerationConfig(backend="local", max_new_tokens=5, max_concurrent_episodes=4, context_strategy="full",
                               reuse_kv_cache=reuse, temperature=temperature, local_batching="wave")
        generator = LocalGenerator(tiny_policy, cfg, seed=0)
        runner = RolloutRunner({"game": ("openspiel", RulesEnv())}, generator,
                               PromptBuilder(tiny_policy.tokenizer, 4096), cfg)
        episodes = asyncio.run(runner.run(_tasks(4), step=0))
        return [[t.response_ids for t in e.turns] for e in episodes], episodes, generator

    shared_replies, episodes, shared = rollout(True)
    whole_replies, _, whole = rollout(False)
    assert shared_replies == whole_replies
    first_prompt = len(episodes[0].prompt_ids(episodes[0].turns[0]))
    # (waves, so that the four first turns join together) the first wave runs the common first prompt (all but its last token) once, then one token per episode
    first_wave = (first_prompt - 1) + 4
    later_turns = shared.prefilled_tokens - first_wave
    assert 0 < later_turns < whole.prompt_tokens - 4 * first_prompt
    assert shared.prefilled_tokens < 0.5 * whole.prefilled_tokens


COMPLETION = {"choices": [{"finish_reason": "stop", "text": "x", "logprobs": {
    "tokens": ["token_id:11"], "token_logprobs": [-0.5]}}]}


class RestartingServer:
    """A mock vLLM that refuses connections for its first `down_for` requests, then answers as a freshly
    restarted server: the base model only, until an adapter is loaded."""

    def __init__(self, down_for: int):
        self.down_for = down_for
        self.adapters: list[str] = []
        self.log: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.log.append(f"{request.method} {request.url.path}")
        if len(self.log) <= self.down_for:
            raise httpx.ConnectError("Connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base"}] + [{"id": name} for name in self.adapters]})
        if request.url.path == "/v1/load_lora_adapter":
            self.adapters.append(json.loads(request.content)["lora_name"])
            return httpx.Response(200, text="Success")
        if json.loads(request.content)["model"] not in ["base", *self.adapters]:
            return httpx.Response(404, json={"message": "The model does not exist."})
        return httpx.Response(200, json=COMPLETION)


def vllm_generator(policy, server, **config) -> VLLMGenerator:
    generator = VLLMGenerator("http://vllm/v1", "base", policy.tokenizer, GenerationConfig(**config), 8, {2})
    generator.client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return generator


def test_a_restarted_vllm_gets_the_adapter_back_before_any_request_and_the_episode_is_replayed(tiny_policy, tmp_path):
    from ppo_affine.envs.base import EpisodeLost

    server = RestartingServer(down_for=3)  # two tries of the completion, the first wait's health check
    generator = vllm_generator(tiny_policy, server, request_retries=1)
    generator.loaded, generator.active_adapter = {"run-step-4": tmp_path}, "run-step-4"

    async def generate_twice():
        with pytest.raises(EpisodeLost, match="went away mid-episode"):
            await generator.generate([1, 2], order_key=0, seed=5)
        return await generator.generate([1, 2], order_key=0, seed=5)

    assert asyncio.run(generate_twice()).token_ids == [11]
    assert server.log == ["POST /v1/completions"] * 2 + ["GET /v1/models"] * 2 + ["POST /v1/load_lora_adapter",
                                                                                  "POST /v1/completions"]
    assert server.adapters == ["run-step-4"] and generator.outages == 1


def test_a_vllm_that_lost_the_adapter_without_a_refused_request_still_gets_it_back(tiny_policy, tmp_path):
    from ppo_affine.envs.base import EpisodeLost

    server = RestartingServer(down_for=0)  # restarted between two requests: it answers, without the adapter
    generator = vllm_generator(tiny_policy, server)
    generator.loaded, generator.active_adapter = {"run-step-4": tmp_path}, "run-step-4"
    with pytest.raises(EpisodeLost, match="restarted without adapter 'run-step-4'"):
        asyncio.run(generator.generate([1, 2], order_key=0, seed=5))
    assert server.adapters == ["run-step-4"]


def test_a_vllm_that_stays_away_past_the_wait_stops_the_run_with_the_field(tiny_policy):
    from ppo_affine.generation import VLLMError

    server = RestartingServer(down_for=10**6)
    generator = vllm_generator(tiny_policy, server, request_retries=0, server_wait_seconds=2)
    with pytest.raises(VLLMError, match=r"not back within generation.server_wait_seconds=2\b.*--resume latest"):
        asyncio.run(generator.generate([1, 2], order_key=0, seed=5))
    polls = server.log.count("GET /v1/models")
    assert 2 <= polls <= 3  # at 0, 1 and 2 s (backing off)
    with pytest.raises(VLLMError):  # once given up, later requests fail at once instead of waiting again
        asyncio.run(generator.generate([1, 2], order_key=1, seed=6))
    assert server.log.count("GET /v1/models") == polls


def test_an_answering_vllm_that_fails_a_request_is_an_error_not_a_wait(tiny_policy):
    from ppo_affine.generation import VLLMError

    def broken(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base"}]})
        return httpx.Response(500, text="internal error")

    generator = vllm_generator(tiny_policy, broken, request_retries=0)
    with pytest.raises(VLLMError, match="failed after 1 attempts: HTTP 500"):
        asyncio.run(generator.generate([1, 2], order_key=0, seed=5))


def served_check(app, tokenizer, temperature: float, sampler_logprobs: bool = True) -> None:
    """VLLMGenerator.check_server against the fake vLLM app in this process."""
    async def check():
        generator = VLLMGenerator("http://fake/v1", "tiny", tokenizer, GenerationConfig(temperature=temperature),
                                  16, {0})
        generator.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        try:
            await generator.check_server(sampler_logprobs)
        finally:
            await generator.client.aclose()

    asyncio.run(check())


def test_training_at_a_temperature_refuses_a_server_returning_raw_logprobs_naming_the_flag(tiny_model_dir):
    from transformers import AutoTokenizer

    from ppo_affine.generation import VLLMError
    from ppo_affine.testing import fake_vllm

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = fake_vllm.build_app(str(tiny_model_dir), served_name="tiny")  # vLLM's default
    with pytest.raises(VLLMError, match=r"raw log-probs, not those .* generation.temperature=0.7.*restart it with "
                                        r"--logprobs-mode processed_logprobs"):
        served_check(raw, tokenizer, 0.7)
    served_check(raw, tokenizer, 1.0)  # the same numbers at temperature 1
    served_check(raw, tokenizer, 0.7, sampler_logprobs=False)  # an evaluation uses no log-probs
    processed = fake_vllm.build_app(str(tiny_model_dir), served_name="tiny", logprobs_mode="processed_logprobs")
    for temperature in (0.7, 1.3):
        served_check(processed, tokenizer, temperature)


def test_a_request_gets_the_same_tokens_alone_or_batched_with_others(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=6, temperature=1.0, reuse_kv_cache=False)
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (1, 5, 9)]
    batched = replies(LocalGenerator(tiny_policy, cfg, seed=0), prompts, seeds=[11, 12, 13])
    alone = [replies(LocalGenerator(tiny_policy, cfg, seed=0), [p], seeds=[s])[0]
             for p, s in zip(prompts, [11, 12, 13])]
    assert batched == alone
    reseeded = replies(LocalGenerator(tiny_policy, cfg, seed=0), prompts, seeds=[21, 22, 23])
    assert reseeded != batched


class JoinsAfter(LocalGenerator):
    """The real decode loop, where a second request is asked the moment the first has `after` tokens: it joins the
    running batch at the next step (one running row, one waiting: continuous batching lets it in)."""

    def __init__(self, *args, after: int, joiner: tuple[list[int], int], **kwargs):
        super().__init__(*args, **kwargs)
        self.after, self.joiner = after, joiner
        self.joined: asyncio.Task | None = None
        self.batch_keys: list[list[int]] = []  # the rows of every step's running batch

    def _finish_step(self, tokens):
        super()._finish_step(tokens)
        if self._running is not None:
            self.batch_keys.append([r.key for r in self._running.requests])
            if self.joined is None and len(self._running.requests[0].reply) == self.after:
                prompt, seed = self.joiner
                self.joined = asyncio.get_running_loop().create_task(self.generate(prompt, order_key=1, seed=seed))


def test_a_request_joining_a_running_batch_gets_the_tokens_it_gets_alone(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=10, temperature=1.0, reuse_kv_cache=False,
                           local_batching="continuous")
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    first, second = (builder.encode([{"role": "user", "content": "go " * n}]) for n in (2, 30))
    generator = JoinsAfter(tiny_policy, cfg, seed=0, after=3, joiner=(second, 12))
    generator.eos_ids = set()  # both replies run to max_new_tokens, so the first is still decoding when the second joins

    async def ask():
        async with generator.rollout(step=0):
            running = await generator.generate(first, order_key=0, seed=11)
            joined = await generator.joined
        return running.token_ids, joined.token_ids
    running, joined = asyncio.run(ask())
    assert generator.batch_keys[:3] == [[0], [0], [0]] and [0, 1] in generator.batch_keys  # it joined mid-reply
    alone = []
    for prompt, seed in ((first, 11), (second, 12)):
        solo = LocalGenerator(tiny_policy, cfg, seed=0)
        solo.eos_ids = set()
        alone.append(replies(solo, [prompt], seeds=[seed])[0])
    assert [running, joined] == alone and len(running) == len(joined) == 10


def test_the_folded_adapter_gives_the_adapters_logits_and_leaves_the_weights_untouched(tiny_model_dir):
    import torch

    from ppo_affine.local_generation import FoldedAdapter
    from ppo_affine.testing.tiny import activate_adapter, load_tiny_policy

    policy = load_tiny_policy(tiny_model_dir)
    activate_adapter(policy.model, 0.5)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    ids = torch.tensor([[5, 9, 13, 40, 2, 7]])
    policy.eval()
    with torch.no_grad():
        unfolded = policy.model(input_ids=ids).logits
        with policy.base():
            base = policy.model(input_ids=ids).logits
        with FoldedAdapter(policy.model):
            folded = policy.model(input_ids=ids).logits
    assert torch.allclose(folded, unfolded, atol=1e-5) and not torch.allclose(folded, base, atol=1e-3)
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())
    assert all(p.requires_grad == ("lora_" in name) for name, p in policy.model.named_parameters())
    with policy.base():  # the base model's turn: nothing to fold, the generator leaves the adapter path alone
        assert FoldedAdapter.foldable_layers(policy.model) is None


@pytest.mark.parametrize("failing_layer", [1, 5])
def test_a_fold_that_fails_at_a_layer_puts_every_weight_back_and_keeps_the_adapter_path(tiny_model_dir, monkeypatch,
                                                                                         failing_layer):
    from peft.tuners.lora import Linear as LoraLinear

    from ppo_affine.local_generation import FoldedAdapter
    from ppo_affine.testing.tiny import activate_adapter, load_tiny_policy

    policy = load_tiny_policy(tiny_model_dir)
    activate_adapter(policy.model, 0.5)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    ids = torch.tensor([[5, 9, 13, 40, 2, 7]])
    policy.eval()
    with torch.no_grad():
        unfolded = policy.model(input_ids=ids).logits
    delta_weight, folded = LoraLinear.get_delta_weight, []

    def fails_at_the_kth_layer(layer, name):
        folded.append(layer)
        if len(folded) == failing_layer:
            raise RuntimeError("CUDA out of memory (injected)")
        return delta_weight(layer, name)

    monkeypatch.setattr(LoraLinear, "get_delta_weight", fails_at_the_kth_layer)
    with pytest.raises(RuntimeError, match="injected"):
        FoldedAdapter(policy.model).__enter__()
    assert len(folded) == failing_layer
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, unfolded)  # the adapter path is on, nothing added twice
    monkeypatch.setattr(LoraLinear, "get_delta_weight", delta_weight)
    with torch.no_grad(), FoldedAdapter(policy.model):  # and a later fold works
        assert torch.allclose(policy.model(input_ids=ids).logits, unfolded, atol=1e-5)


def test_a_fold_whose_adapter_switch_fails_puts_every_weight_back(tiny_model_dir, monkeypatch):
    from ppo_affine.local_generation import FoldedAdapter
    from ppo_affine.testing.tiny import activate_adapter, load_tiny_policy

    policy = load_tiny_policy(tiny_model_dir)
    activate_adapter(policy.model, 0.5)  # a delta that changes the weights it is folded into
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}

    def switch_fails():
        raise RuntimeError("switch failed (injected)")

    monkeypatch.setattr(policy.model, "disable_adapter", switch_fails)
    with pytest.raises(RuntimeError, match="injected"):
        FoldedAdapter(policy.model).__enter__()
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())


def test_local_generation_folds_float32_weights_and_keeps_the_adapter_path_for_bfloat16(tiny_model_dir, caplog):
    from ppo_affine.testing.tiny import load_tiny_policy

    cfg = GenerationConfig(backend="local")
    policy = load_tiny_policy(tiny_model_dir)
    assert LocalGenerator(policy, cfg, seed=0).folds_adapter()
    assert not LocalGenerator(policy, cfg.model_copy(update={"fold_adapter": False}), seed=0).folds_adapter()
    policy.model.to(torch.bfloat16)
    generator = LocalGenerator(policy, cfg, seed=0)
    with caplog.at_level("INFO", logger="ppo_affine.local_generation"):
        assert not generator.folds_adapter() and not generator.folds_adapter()
    assert caplog.text.count("generation.fold_adapter: the adapter path runs (the weights are torch.bfloat16") == 1


# ---------------------------------------------------------------------- no copy from the host after a launch
class CopiesAndModelOps(TorchFunctionMode):
    """Records in order every tensor made or moved with an explicit device ("copy") and every operation inside the
    model's forward ("model"). On a GPU a copy from the host after a launch waits for the launched kernels."""

    def __init__(self, model):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self.depth = 0  # > 0 inside the model's forward
        self.hooks = [model.register_forward_pre_hook(lambda *_: self._enter()),
                      model.register_forward_hook(lambda *_: self._leave())]

    def _enter(self):
        self.depth += 1

    def _leave(self):
        self.depth -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        result = func(*args, **kwargs)
        if self.depth:
            self.events.append(("model", name))
        elif kwargs.get("device") is not None or (name in ("to", "cuda") and any(
                isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])):
            # an empty tensor carries nothing (a cache layer's first keys): PyTorch copies no zero-element tensor
            if not (isinstance(result, torch.Tensor) and result.numel() == 0):
                self.events.append(("copy", name))
        return result


class RecordsEachStep(JoinsAfter):
    """The real decode loop (a second request joining mid-reply, with a kept cache and shared prefixes in play),
    each step's launch recorded in the thread it runs in."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[dict] = []

    def _compute_step(self, joining):
        recorder = CopiesAndModelOps(self.policy.model)
        decoding = self._running is not None
        try:
            with torch.no_grad(), recorder:
                sampled = self._launch_step(joining)
        finally:
            for hook in recorder.hooks:
                hook.remove()
        self.steps.append({"decode": decoding, "joining": len(joining), "events": recorder.events})
        return self._device_values(sampled)


def test_no_step_copies_from_the_host_after_its_first_model_operation(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=6, temperature=1.0, reuse_kv_cache=True,
                           local_batching="continuous")
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    rules = "Rules: " + "play well " * 20
    first = builder.encode([{"role": "user", "content": "go"}])
    joiners = [builder.encode([{"role": "user", "content": rules + end}]) for end in ("a", "b")]
    generator = RecordsEachStep(tiny_policy, cfg, seed=0, after=2, joiner=(joiners[0], 12))
    generator.eos_ids = set()

    async def ask():
        async with generator.rollout(step=0):
            await generator.generate(first, order_key=0, seed=11)
            await generator.joined
            # two fresh rows beginning alike join together: their shared prefix runs once, in the step
            await asyncio.gather(*(generator.generate(p, order_key=2 + i, seed=i) for i, p in enumerate(joiners)))
    asyncio.run(ask())
    kinds = {(step["decode"], step["joining"] > 0) for step in generator.steps}
    assert kinds == {(False, True), (True, False), (True, True)}  # prefill alone, decode alone, decode + prefill
    assert generator.forward_calls > len(generator.steps) + 1  # joins ran prefills beside decodes, and a shared prefix
    for step in generator.steps:
        events = step["events"]
        first_model_op = next(i for i, (kind, _) in enumerate(events) if kind == "model")
        late = [name for kind, name in events[first_model_op:] if kind == "copy"]
        assert late == [], (step["decode"], step["joining"], late)
        assert any(kind == "copy" for kind, _ in events[:first_model_op])  # the staged copies were seen


# ---------------------------------------------------------------------- stopping at the closing fence
class FencedReplies(LocalGenerator):
    """The real decode loop, replying with a fenced answer and then a loop that never ends by itself."""

    def _choose(self, logits, requests, keys):
        script = self.tokenizer.encode("```\n7\n```" + " and again" * 40, add_special_tokens=False)
        return torch.tensor([script[len(r.reply)] for r in requests], device=logits.device), torch.zeros(len(requests))


@pytest.mark.parametrize("stop", [True, False])
def test_a_local_reply_ends_at_its_closing_fence_with_the_setting_and_runs_on_without(tiny_policy, stop):
    cfg = GenerationConfig(backend="local", max_new_tokens=40, stop_at_closing_fence=stop)
    prompt = PromptBuilder(tiny_policy.tokenizer, 4096).encode([{"role": "user", "content": "go"}])
    [reply] = replies(FencedReplies(tiny_policy, cfg, seed=0), [prompt])
    text = tiny_policy.tokenizer.decode(reply)
    if stop:  # the token that closed the fence is the last one: nothing after it was generated
        assert text.rstrip().endswith("```") and text.count("```") == 2 and "again" not in text
        assert not tiny_policy.tokenizer.decode(reply[:-1]).rstrip().endswith("```")
    else:
        assert len(reply) == 40 and "again" in text


def test_a_vllm_reply_stopped_at_its_opening_fence_goes_on_until_the_fence_closes(tiny_policy):
    tokenizer = tiny_policy.tokenizer
    opening, rest = tokenizer.encode("```", add_special_tokens=False), tokenizer.encode("\n5\n```",
                                                                                          add_special_tokens=False)
    requests = []

    def serve(request: httpx.Request) -> httpx.Response:  # vLLM with stop ["```"]: it stops at every fence
        body = json.loads(request.content)
        requests.append(body)
        tokens = opening if len(requests) == 1 else rest
        return httpx.Response(200, json={"choices": [{"finish_reason": "stop", "stop_reason": "```", "logprobs": {
            "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.25] * len(tokens)}}]})

    cfg = GenerationConfig(max_new_tokens=32, stop_at_closing_fence=True)
    generator = VLLMGenerator("http://vllm/v1", "base", tokenizer, cfg, 8, {2})
    generator.client = httpx.AsyncClient(transport=httpx.MockTransport(serve))
    generation = asyncio.run(generator.generate([1, 2], order_key=0, seed=5))
    assert generation.token_ids == opening + rest and generation.logprobs == [-0.25] * len(opening + rest)
    first, second = requests
    assert first["stop"] == ["```"] and first["include_stop_str_in_output"] and first["prompt"] == [1, 2]
    assert second["prompt"] == [1, 2] + opening and second["max_tokens"] == 32 - len(opening)
    assert second["seed"] != first["seed"] and generator.in_flight["base"] == 0

    requests.clear()  # without the setting: one request, no stop strings
    plain = VLLMGenerator("http://vllm/v1", "base", tokenizer, GenerationConfig(max_new_tokens=32), 8, {2})
    plain.client = httpx.AsyncClient(transport=httpx.MockTransport(serve))
    assert asyncio.run(plain.generate([1, 2], order_key=0, seed=5)).token_ids == opening
    assert len(requests) == 1 and "stop" not in requests[0]


# ---------------------------------------------------------------------- the decode step's ready-made mask
class LogitsKept(LocalGenerator):
    """The real decode loop, keeping every decode step's logits; `bias` False hands the model the 2D mask."""

    def __init__(self, *args, bias: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []
        self.padded_steps = 0
        if not bias:
            self._bias_dtype = None

    def _choose(self, logits, requests, keys):
        self.logits.append(logits.detach().clone())
        return super()._choose(logits, requests, keys)

    def _decode_step(self, staged):
        super()._decode_step(staged)
        bias = self._running.bias
        if bias is not None and bool(torch.isinf(bias).any()):
            self.padded_steps += 1  # a step whose mask hid some row's padding


@pytest.mark.parametrize("batching", ["wave", "continuous"])
def test_the_decode_steps_additive_mask_gives_the_2d_masks_logits_and_tokens(tiny_policy, batching):
    """Rows of different widths, kept caches, rows leaving mid-batch (and joining under continuous batching): the
    mask kept from step to step as the attention adds it scores every row as transformers' own mask does."""
    from ppo_affine.local_generation import decode_bias_dtype

    assert decode_bias_dtype(tiny_policy.model) == torch.float32
    cfg = GenerationConfig(backend="local", max_new_tokens=5, max_concurrent_episodes=3, reuse_kv_cache=True,
                           temperature=1.0, local_batching=batching)
    played = {}
    for bias in (True, False):
        generator = LogitsKept(tiny_policy, cfg, seed=0, bias=bias)
        runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, generator,
                               PromptBuilder(tiny_policy.tokenizer, 4096), cfg)
        episodes = asyncio.run(runner.run(_tasks(5), step=0))
        played[bias] = ([[t.response_ids for t in e.turns] for e in episodes], generator.logits)
    assert played[True][0] == played[False][0]
    if batching == "wave":  # the same steps in the same batches: the same scores, to float noise (measured up to
        # 7e-6 on logits of size ~3: a row without padding gets no mask at all from transformers, so another kernel)
        assert len(played[True][1]) == len(played[False][1]) > 5
        for with_bias, with_2d in zip(played[True][1], played[False][1]):
            assert torch.allclose(with_bias, with_2d, atol=1e-5, rtol=0)


def test_the_ready_made_mask_is_only_handed_to_attention_that_takes_one_mask_for_every_layer(tiny_policy):
    from ppo_affine.local_generation import decode_bias_dtype

    config = tiny_policy.model.config
    saved = config._attn_implementation, getattr(config, "layer_types", None)
    try:
        config.layer_types = ["full_attention", "sliding_attention"]
        assert decode_bias_dtype(tiny_policy.model) is None  # a sliding layer needs a mask of its own
        config.layer_types = saved[1]
        config._attn_implementation = "flash_attention_2"  # takes the 2D mask, not a 4D one
        assert decode_bias_dtype(tiny_policy.model) is None
    finally:
        config._attn_implementation, config.layer_types = saved


class LeavingOneByOne(LogitsKept):
    """Greedy rows that end (EOS) after a set number of tokens each, so rows leave the batch one by one."""

    def __init__(self, *args, stops: dict[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.stops, self.widths = stops, []

    def _choose(self, logits, requests, keys):
        self.logits.append(logits.detach().clone())
        self.widths.append(self._running.width if self._running is not None else None)
        eos = self.tokenizer.eos_token_id
        tokens = [eos if len(r.reply) + 1 >= self.stops[r.key] else int(row.argmax()) for r, row in zip(requests, logits)]
        return torch.tensor(tokens, device=logits.device), torch.zeros(len(requests))


def test_the_additive_mask_follows_rows_that_leave_and_columns_that_are_cut(tiny_policy):
    """Prompts of 3 to ~80 tokens decoded together; the longest row leaves first, so the columns only it used
    are cut: at every step the scores equal those of the 2D mask's path."""
    cfg = GenerationConfig(backend="local", max_new_tokens=12, temperature=0.0, reuse_kv_cache=False,
                           local_batching="wave")
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (1, 4, 70)]
    stops = {0: 9, 1: 6, 2: 2}  # the 70-word prompt's row leaves after its 2nd token
    runs = {}
    for bias in (True, False):
        generator = LeavingOneByOne(tiny_policy, cfg, seed=0, bias=bias, stops=stops)
        runs[bias] = (replies(generator, prompts), generator)
    assert runs[True][0] == runs[False][0]
    assert [len(reply) for reply in runs[True][0]] == [9, 6, 2]
    with_bias, with_2d = runs[True][1], runs[False][1]
    assert with_bias.padded_steps > 0 and with_2d.padded_steps == 0
    widths = [w for w in with_bias.widths if w is not None]
    assert any(later < earlier for earlier, later in zip(widths, widths[1:]))  # columns were cut
    assert len(with_bias.logits) == len(with_2d.logits)
    for kept, plain in zip(with_bias.logits, with_2d.logits):
        assert torch.allclose(kept, plain, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- memory: the KV budget, out of memory
class KeepsTrack(LocalGenerator):
    """The real decode loop, noting the tokens of kept caches after every cache it keeps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: list[int] = []

    def _remember(self, key, cache):
        super()._remember(key, cache)
        self.held.append(sum(len(kept.ids) for kept in self._caches.values()))


def played_with(policy, generator_class, **settings):
    cfg = GenerationConfig(backend="local", max_new_tokens=5, max_concurrent_episodes=3, temperature=1.0, **settings)
    generator = generator_class(policy, cfg, seed=0)
    runner = RolloutRunner({"game": ("openspiel", CountingEnv())}, generator, PromptBuilder(policy.tokenizer, 4096),
                           cfg)
    episodes = asyncio.run(runner.run(_tasks(5), step=0))
    return [[t.response_ids for t in e.turns] for e in episodes], generator


def test_kept_caches_past_the_budget_drop_the_least_recently_used_and_change_no_token(tiny_policy):
    unbounded, plenty = played_with(tiny_policy, KeepsTrack, kv_cache_budget=10**9)
    bounded, tight = played_with(tiny_policy, KeepsTrack, kv_cache_budget=60)
    assert bounded == unbounded
    assert plenty.evicted_caches == 0 and max(plenty.held) == 176  # kept unbounded: up to 176 tokens
    assert tight.evicted_caches > 0 and max(tight.held) <= 60
    assert tight.prefilled_tokens > plenty.prefilled_tokens  # a dropped episode's next turn is prefilled again


def test_the_default_budget_is_half_the_free_memory_in_tokens_of_the_models_cache(tiny_policy, monkeypatch):
    """The tiny model: 2 layers x 2 key/value heads x 8 dims, keys and values in float32 = 256 bytes a token, as
    the caches it keeps measure."""
    from ppo_affine import local_generation

    monkeypatch.setattr(local_generation, "free_memory_bytes", lambda device: 4 * 256 * 1000)
    _, generator = played_with(tiny_policy, KeepsTrack)
    assert generator.cache_bytes_per_token == 256 and generator.cache_budget == 2000
    assert {kept.bytes_per_token() for kept in generator._caches.values()} <= {256.0}


class WatchesTheBatch(KeepsTrack):
    """The real decode loop, noting each step's rows and what the running batch and kept caches hold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[int] = []
        self.held_at_step: list[int] = []

    def _finish_step(self, sampled):
        self.rows.append(len(self._running.requests))
        super()._finish_step(sampled)
        self.held_at_step.append(self.cache_tokens)


def test_the_budget_bounds_the_running_batch_and_the_kept_caches_together_and_changes_no_token(tiny_policy):
    """5 episodes of 3 turns, 3 at once, prompts of ~30 to ~90 tokens, replies up to 5: unbounded, the running batch
    and the kept caches reach 192 tokens; with a budget of 120 they never pass it (rows wait for room, kept caches
    are dropped), and every reply is the one it is unbounded."""
    unbounded, plenty = played_with(tiny_policy, WatchesTheBatch, kv_cache_budget=10**9)
    bounded, tight = played_with(tiny_policy, WatchesTheBatch, kv_cache_budget=120)
    assert bounded == unbounded
    assert max(plenty.held_at_step) == 192 and plenty.steps_held_back == 0 and plenty.evicted_caches == 0
    assert max(tight.held_at_step) <= 120 and tight.steps_held_back > 0 and tight.evicted_caches > 0
    assert len(tight.rows) > len(plenty.rows)  # fewer rows a step: more steps
    assert tight.peak_cache_tokens == max(tight.held_at_step)
    metrics = tight.memory_metrics()
    assert metrics["perf/kv_budget_tokens"] == 120 and metrics["perf/kv_steps_held_back"] == tight.steps_held_back


def test_a_row_longer_than_the_budget_still_runs_alone(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=3, temperature=0.0, kv_cache_budget=5)
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (8, 9)]
    generator = WatchesTheBatch(tiny_policy, cfg, seed=0)
    alone = replies(generator, prompts)
    together = replies(LocalGenerator(tiny_policy, cfg.model_copy(update={"kv_cache_budget": 10**9}), seed=0), prompts)
    assert alone == together and max(generator.rows) == 1 and all(len(reply) == 3 for reply in alone)


class RunsOutOfMemoryAbove(LocalGenerator):
    """The real decode loop on a device that holds at most `rows` rows: a bigger forward call runs out of memory.
    Two more requests join the first two once these have two tokens each."""

    def __init__(self, *args, rows: int, later: list[list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.rows, self.later, self.asked = rows, later, []

    def _forward(self, input_ids, *args):
        if input_ids.shape[0] > self.rows:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super()._forward(input_ids, *args)

    def _finish_step(self, sampled):
        super()._finish_step(sampled)
        if not self.asked and self._running is not None and len(self._running.requests[0].reply) == 2:
            loop = asyncio.get_running_loop()
            self.asked = [loop.create_task(self.generate(p, order_key=2 + i, seed=20 + i))
                          for i, p in enumerate(self.later)]


def test_running_out_of_memory_mid_reply_halves_the_batch_and_every_reply_is_the_one_it_would_have_been(
        tiny_policy, caplog):
    cfg = GenerationConfig(backend="local", max_new_tokens=6, temperature=1.0, reuse_kv_cache=False)
    builder = PromptBuilder(tiny_policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (1, 3, 5, 7)]

    def replies_of(generator):
        generator.eos_ids = set()  # every reply runs to max_new_tokens

        async def ask():
            async with generator.rollout(step=0):
                first = await asyncio.gather(*(generator.generate(p, order_key=i, seed=10 + i)
                                               for i, p in enumerate(prompts[:2])))
                later = await asyncio.gather(*generator.asked)
            return [g.token_ids for g in first + later]
        return asyncio.run(ask())

    plenty = replies_of(RunsOutOfMemoryAbove(tiny_policy, cfg, seed=0, rows=8, later=prompts[2:]))
    short = RunsOutOfMemoryAbove(tiny_policy, cfg, seed=0, rows=2, later=prompts[2:])
    with caplog.at_level("WARNING", logger="ppo_affine.local_generation"):
        squeezed = replies_of(short)
    # the 4-row decode step failed with two tokens of the first replies drawn; each row rejoined with its reply so far
    assert squeezed == plenty and all(len(reply) == 6 for reply in squeezed)
    assert short.row_cap == 2 and short.out_of_memory_retries == 1
    assert "ran out of memory with 4 rows" in caplog.text and "at most 2 rows decode at once" in caplog.text


def test_running_out_of_memory_on_a_single_row_fails_its_request(tiny_policy):
    cfg = GenerationConfig(backend="local", max_new_tokens=4, reuse_kv_cache=False)
    generator = RunsOutOfMemoryAbove(tiny_policy, cfg, seed=0, rows=0, later=[])
    prompt = PromptBuilder(tiny_policy.tokenizer, 4096).encode([{"role": "user", "content": "go"}])
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        replies(generator, [prompt])


def test_the_adapter_probe_judges_the_servers_log_probs_against_the_trainers_move():
    """applied: the server's log-probs of the sampled tokens are within 1/4 of the probe's move of the trainer's."""
    from ppo_affine.generation import ProbeReading

    base, probe = [-1.0, -2.0, -0.5], [-3.0, -1.0, -0.4]  # the probe moved the trainer by up to 2.0 nats
    applied = ProbeReading(served=[-2.9, -1.2, -0.4], trainer_base=base, trainer_probe=probe)
    assert (applied.moved, round(applied.gap, 6), applied.applied) == (2.0, 0.2, True)
    ignored = ProbeReading(served=base, trainer_base=base, trainer_probe=probe)  # the engine served the base model
    assert (ignored.gap, ignored.applied) == (2.0, False)
    half = ProbeReading(served=[-2.0, -1.5, -0.45], trainer_base=base, trainer_probe=probe)  # part of it dropped
    assert (half.gap, half.applied) == (1.0, False)
    assert not ProbeReading([float("nan")] * 3, base, probe).applied
