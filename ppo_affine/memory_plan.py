"""How much GPU memory a run takes, term by term, and which settings fit one GPU.

Every term is arithmetic on the model's config and the run's settings, except the activations a layer keeps for
its backward pass, which are measured (`probe_activations`): one layer of each kind at the model's real width runs
forward with LoRA on a few tokens and the tensors autograd saves are counted (`saved_tensors_hooks`), so the
number is the architecture's own code's, not a guess. A layer's saved activations grow linearly with its tokens
(attention keeps no T x T matrix: SDPA's fused kernels), so the per-token figure scales to a micro-batch.

Terms of the trainer:
- weights, by what they are stored as: with model.use_4bit bitsandbytes stores the nn.Linear layers (not lm_head)
  in NF4 (0.5 byte a weight, plus its double-quantised block scales: 1/64 + 4/16384 byte) and peft's k-bit
  preparation keeps every other floating weight in float32; an MoE's fused routed experts are no nn.Linear, so
  they stay, in float32. Without 4-bit every weight is model.dtype;
- the adapter and its optimizer: float32 weights, gradients and AdamW's two moments: 16 bytes a trainable weight;
- activations of the largest pass: a micro-batch of ppo.micro_batch_tokens, or the longest sequence the run can
  produce (max_prompt_tokens + max_new_tokens), which gets a micro-batch of its own: every layer's saved tensors, or
  with gradient checkpointing every layer's input plus one layer's saved tensors (recomputed in the backward), and
  the backward's gradients of one layer;
- the LM head's logits for one chunk of reply tokens (it runs per chunk, again in backward), their gradients and
  float32 copies, and the reply tokens' hidden states gathered for it;
- local generation's caches: every live episode's keys and values (and linear-attention states) at its longest
  context, generation.max_concurrent_episodes x (max_prompt_tokens + max_new_tokens);
- a fixed reserve for the CUDA context and allocator slack.
vLLM on the same GPU: its weights in the served dtype (the dequantised copy with 4-bit), the KV cache and states
its scheduler needs for the same episodes, its LoRA slots, and its own reserve; `--gpu-memory-utilization` is that
sum over the GPU. The plan is arithmetic, not the CUDA allocator: docs/architectures.md compares it with CPU runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ppo_affine.architectures import default_lora_targets, expert_lora_parameters

GB = 1e9
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit block scales + their float32 scales
ADAPTER_BYTES = 16  # float32 weight + gradient + AdamW m and v
CUDA_RESERVE = 2.0 * GB  # context, cuBLAS workspaces, allocator slack
VLLM_RESERVE = 3.0 * GB  # vLLM's activations, sampler and CUDA graphs beside weights and KV cache
HEADROOM = 0.95  # a plan fits in 95 % of the GPU: the CUDA allocator fragments what it caches
PROBE_TOKENS = 64
# With gradient checkpointing, a recomputed layer's backward holds its saved tensors and the gradients it makes, which
# free as they are used: measured at 1.14 times the saved tensors (tiny qwen3_5_moe, 16 k tokens, float32:
# tests/test_memory_plan.py), rounded up
RECOMPUTED_LAYER = 1.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RunShape:
    """The settings the plan reads (model, LoRA, PPO and generation fields of a TrainConfig)."""
    dtype_bytes: int
    use_4bit: bool
    gradient_checkpointing: bool
    micro_batch_tokens: int
    lora_r: int
    lora_targets: list[str] | None
    adapt_experts: bool
    backend: str
    episodes: int
    context_tokens: int  # generation's longest context: max_prompt_tokens + max_new_tokens
    longest_sequence: int | None = None  # the longest sequence a pass trains on; None: context_tokens

    @classmethod
    def of(cls, train, gpu: bool = True) -> "RunShape":
        dtype = train.model.dtype if train.model.dtype != "auto" else ("bfloat16" if gpu else "float32")
        gen = train.generation
        context = gen.max_prompt_tokens + gen.max_new_tokens
        return cls(DTYPE_BYTES[dtype], train.model.use_4bit, train.model.gradient_checkpointing,
                   train.ppo.micro_batch_tokens, train.lora.r, train.lora.target_modules, train.lora.adapt_experts,
                   gen.backend, gen.max_concurrent_episodes, context,
                   min(context, train.ppo.max_sequence_tokens or context))

    @property
    def activation_bytes(self) -> int:
        return 4 if self.use_4bit else self.dtype_bytes  # the k-bit preparation's float32 norms carry float32 on


@dataclass
class Term:
    name: str
    bytes: float
    note: str = ""


@dataclass
class Plan:
    gpu_bytes: float
    trainer: list[Term]
    vllm: list[Term]
    shape: RunShape

    @property
    def trainer_bytes(self) -> float:
        return sum(t.bytes for t in self.trainer)

    @property
    def vllm_bytes(self) -> float:
        return sum(t.bytes for t in self.vllm)

    @property
    def fits(self) -> bool:
        return self.trainer_bytes + self.vllm_bytes <= HEADROOM * self.gpu_bytes

    @property
    def vllm_share(self) -> float:
        """vLLM's --gpu-memory-utilization: its part of the GPU, rounded up to 0.01."""
        return min(1.0, -(-self.vllm_bytes * 100 // self.gpu_bytes) / 100)


def meta_model(config):
    """The model the trainer loads, built on the meta device: every weight's shape and kind, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def weight_terms(model, shape: RunShape) -> list[Term]:
    linear = {id(m.weight) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")}
    quantised = other = 0
    for parameter in model.parameters():
        if shape.use_4bit and id(parameter) in linear:
            quantised += parameter.numel()
        else:
            other += parameter.numel()
    if not shape.use_4bit:
        return [Term("weights", other * shape.dtype_bytes, f"{other / 1e9:.2f} B weights at {shape.dtype_bytes} bytes")]
    return [Term("weights (NF4)", quantised * NF4_BYTES, f"{quantised / 1e9:.2f} B nn.Linear weights"),
            Term("weights (float32, not quantised)", other * 4,
                 f"{other / 1e9:.2f} B: embeddings, lm_head, norms, fused experts")]


def trainable_parameters(model, shape: RunShape) -> int:
    """LoRA's weights on this architecture: r x (in + out) per adapted linear layer, and per expert of each adapted
    fused expert weight."""
    targets = set(shape.lora_targets or default_lora_targets(model.config))
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            count += shape.lora_r * (module.in_features + module.out_features)
    if shape.adapt_experts:
        wanted = expert_lora_parameters(model)
        for name, parameter in model.named_parameters():
            if any(name.endswith(suffix) for suffix in wanted):  # [experts, out, in]
                experts, out_features, in_features = parameter.shape
                count += experts * shape.lora_r * (in_features + out_features)
    return count


def kv_bytes_per_token(config, element_bytes: int) -> tuple[float, float]:
    """(bytes of keys and values a token adds over all full-attention layers, bytes of linear-attention state per
    sequence over all linear layers)."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    full = sum(kind != "linear_attention" for kind in kinds)
    per_token = 2 * full * text.num_key_value_heads * head_dim * element_bytes
    linear = len(kinds) - full
    state = 0.0
    if linear:
        conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + \
            text.linear_num_value_heads * text.linear_value_head_dim
        recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
        state = linear * (conv_dim * text.linear_conv_kernel_dim * element_bytes + recurrent * 4)  # state in float32
    return per_token, state


def probe_activations(config, shape: RunShape, device: str = "cpu") -> dict[str, float]:
    """Saved activation bytes per token of one decoder layer of each kind at the model's real width, with LoRA,
    measured: a model of one layer per kind (a small vocabulary: the vocabulary does not enter a layer) runs
    PROBE_TOKENS tokens forward and autograd's saved tensors are summed, weights excluded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    text = config.get_text_config()
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or ["full_attention"]))
    per_kind = {}
    for kind in kinds:
        probe_config = type(text).from_dict({**text.to_dict(), "num_hidden_layers": 1, "vocab_size": 512,
                                             **({"layer_types": [kind]} if hasattr(text, "layer_types") else {})})
        dtype = torch.float32 if shape.activation_bytes == 4 else torch.bfloat16
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(probe_config, dtype=dtype).to(device)
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        targets = [t for t in (shape.lora_targets or default_lora_targets(probe_config)) if t in names]
        experts = expert_lora_parameters(model) if shape.adapt_experts else None
        model = get_peft_model(model, LoraConfig(r=shape.lora_r, lora_alpha=2 * shape.lora_r, lora_dropout=0.0,
                                                 target_modules=targets, target_parameters=experts or None))
        saved: dict[int, int] = {}

        def keep(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ids = torch.randint(0, 512, (1, PROBE_TOKENS), device=device)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model.get_base_model().get_decoder()(input_ids=ids, use_cache=False)
        per_kind[kind] = sum(size for pointer, size in saved.items() if pointer not in weights) / PROBE_TOKENS
        del model
    return per_kind


def pass_tokens(shape: RunShape) -> int:
    """The most tokens one forward and backward holds: a micro-batch of ppo.micro_batch_tokens, or the longest
    sequence the run can produce (max_prompt_tokens + max_new_tokens: an agent episode whose turns extend each other
    is one such sequence), which gets a micro-batch of its own whatever the budget."""
    return max(shape.micro_batch_tokens, _longest(shape))


def _longest(shape: RunShape) -> int:
    return shape.context_tokens if shape.longest_sequence is None else shape.longest_sequence


def _largest_pass(shape: RunShape) -> str:
    return "the longest sequence" if _longest(shape) >= shape.micro_batch_tokens else "a micro-batch"


def longest_that_fits(config, shape: RunShape, gpu_bytes: float, per_kind: dict[str, float] | None = None,
                      model=None) -> int:
    """The longest sequence one training pass of this run holds on the GPU, every other term as it is (the value for
    ppo.max_sequence_tokens); 0 when not even a micro-batch does."""
    model = model if model is not None else meta_model(config)
    per_kind = per_kind or probe_activations(config, shape)

    def fits(tokens: int) -> bool:
        return plan(config, dataclasses.replace(shape, longest_sequence=tokens), gpu_bytes, per_kind, model).fits

    low, high = 0, 1 << 22  # 4 M tokens: past any context a model takes
    if not fits(shape.micro_batch_tokens):
        return 0
    low = shape.micro_batch_tokens
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def logit_bytes(shape: RunShape, vocab: int, hidden: int) -> float:
    """The LM head's memory in one pass: it runs on one chunk of reply tokens at a time (ppo.CHUNK_ELEMENTS logits)
    and again in backward, so one chunk's logits, their gradient and float32 log-softmax copies (measured at 3
    model-dtype copies and one float32 one per logit), plus every reply token's gathered hidden state and its
    gradient, which grow with the sequence."""
    from ppo_affine.ppo import CHUNK_ELEMENTS

    tokens = pass_tokens(shape)
    chunk_rows = min(tokens, max(1, CHUNK_ELEMENTS // vocab))
    return chunk_rows * vocab * (3 * shape.activation_bytes + 4) + tokens * hidden * 2 * shape.activation_bytes


def _recomputed_layer_bytes(shape: RunShape, per_kind: dict[str, float]) -> float:
    """With gradient checkpointing, the backward of the largest layer: its recomputed saved tensors and the
    gradients it makes, which free as it goes (RECOMPUTED_LAYER times the saved tensors)."""
    return pass_tokens(shape) * RECOMPUTED_LAYER * max(per_kind.values())


def activation_bytes(config, shape: RunShape, per_kind: dict[str, float]) -> float:
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    tokens = pass_tokens(shape)
    if shape.gradient_checkpointing:  # each layer's input kept, one layer's saved tensors alive at a time
        return tokens * len(kinds) * text.hidden_size * shape.activation_bytes + _recomputed_layer_bytes(shape, per_kind)
    # the backward pass holds one layer's gradients beside what is saved: about that layer's saved tensors again
    return tokens * (sum(per_kind[kind] for kind in kinds) + max(per_kind.values()))


def head_bytes(shape: RunShape, per_kind: dict[str, float], vocab: int, hidden: int) -> float:
    """The LM head's memory beyond the activations: all of it without checkpointing (every layer's saved tensors
    wait for the backward meanwhile); with checkpointing the head's forward and backward finish before any layer is
    recomputed, so only what it holds beyond the recomputed layer's memory."""
    logits = logit_bytes(shape, vocab, hidden)
    if not shape.gradient_checkpointing:
        return logits
    return max(0.0, logits - _recomputed_layer_bytes(shape, per_kind))


def plan(config, shape: RunShape, gpu_bytes: float, per_kind: dict[str, float] | None = None, model=None) -> Plan:
    """Every term of the trainer and of a vLLM server on the same GPU for this model and run (`model`: its
    meta_model, when the caller has built it already)."""
    model = model if model is not None else meta_model(config)
    per_kind = per_kind or probe_activations(config, shape)
    trainable = trainable_parameters(model, shape)
    total_weights = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    trainer = weight_terms(model, shape) + [
        Term("adapter + AdamW", trainable * ADAPTER_BYTES, f"{trainable / 1e6:.1f} M trainable weights"),
        Term("activations", activation_bytes(config, shape, per_kind),
             f"{pass_tokens(shape)} tokens ({_largest_pass(shape)}), checkpointing "
             f"{'on' if shape.gradient_checkpointing else 'off'}"),
        Term("logits", head_bytes(shape, per_kind, vocab, config.get_text_config().hidden_size),
             "one chunk of the LM head, every token a reply token" + (
                 "; beyond the recomputed layer's (never alive together)" if shape.gradient_checkpointing else "")),
        Term("CUDA reserve", CUDA_RESERVE),
    ]
    kv_token, state = kv_bytes_per_token(config, shape.activation_bytes)
    if shape.backend == "local":
        trainer.append(Term("local generation caches", shape.episodes * (shape.context_tokens * kv_token + state),
                            f"{shape.episodes} episodes x {shape.context_tokens} tokens"))
        return Plan(gpu_bytes, trainer, [], shape)
    served_bytes = 2  # the served copy is 16-bit
    kv_token16, state16 = kv_bytes_per_token(config, served_bytes)
    lora_slots = 2 * trainable * served_bytes  # the active adapter and the one being loaded
    vllm = [Term("vLLM weights", total_weights * served_bytes, f"{total_weights / 1e9:.2f} B at 16 bits"),
            Term("vLLM KV cache", shape.episodes * (shape.context_tokens * kv_token16 + state16),
                 f"{shape.episodes} episodes x {shape.context_tokens} tokens"),
            Term("vLLM LoRA slots", lora_slots), Term("vLLM reserve", VLLM_RESERVE)]
    return Plan(gpu_bytes, trainer, vllm, shape)


def fitting_settings(config, shape: RunShape, gpu_bytes: float, probes: dict | None = None,
                     model=None) -> tuple[Plan, list[str]]:
    """The run's own plan if it fits; else, of the settings that fit, the one that changes least, in this order of
    reluctance: keeping vLLM (sampling is faster there), not quantising, episodes at once, micro-batch size, then
    gradient checkpointing. Returns that plan and the settings it changes, or the run's own plan and no changes
    when nothing fits. `probes` (use_4bit -> measured activations) and `model` (its meta_model) may be shared
    between calls for several GPUs: measuring a layer at full width takes about a minute."""
    model = model if model is not None else meta_model(config)
    probes = probes if probes is not None else {}

    def plan_of(candidate: RunShape) -> Plan:
        if candidate.use_4bit not in probes:
            probes[candidate.use_4bit] = probe_activations(config, candidate)
        return plan(config, candidate, gpu_bytes, probes[candidate.use_4bit], model)

    own = plan_of(shape)
    if own.fits:
        return own, []
    choices = []
    for backend in dict.fromkeys([shape.backend, "local"]):
        for use_4bit in dict.fromkeys([shape.use_4bit, True]):
            for checkpointing in dict.fromkeys([shape.gradient_checkpointing, True]):
                for halvings_e in range(_halvings(shape.episodes, 8) + 1):
                    for halvings_t in range(_halvings(shape.micro_batch_tokens, 1024) + 1):
                        candidate = dataclasses.replace(
                            shape, backend=backend, use_4bit=use_4bit, gradient_checkpointing=checkpointing,
                            episodes=shape.episodes >> halvings_e, micro_batch_tokens=shape.micro_batch_tokens >> halvings_t)
                        reluctance = (backend != shape.backend, use_4bit != shape.use_4bit, halvings_e, halvings_t,
                                      checkpointing != shape.gradient_checkpointing)
                        choices.append((reluctance, candidate))
    for _, candidate in sorted(choices, key=lambda choice: choice[0]):
        trial = plan_of(candidate)
        if trial.fits:
            return trial, _changes(shape, candidate)
    return own, []


# The data-centre cards a run is planned on, by their memory: what `prepare_model.py --plan` names
CARDS = (("H100 / A100 80 GB", 80.0), ("H200 141 GB", 141.0), ("B200 192 GB", 192.0))


def cards_that_fit(config, shape: RunShape, probes: dict | None = None, model=None
                   ) -> list[tuple[str, Plan, list[str]]]:
    """For each of CARDS: its plan and the settings it changes (the run's own plan and none where nothing fits).
    `probes` and `model` as fitting_settings takes them."""
    model = model if model is not None else meta_model(config)
    probes = probes if probes is not None else {}
    return [(card, *fitting_settings(config, shape, gb * GB, probes, model)) for card, gb in CARDS]


def describe_cards(cards: list[tuple[str, Plan, list[str]]]) -> list[str]:
    lines = ["cards (the trainer and any vLLM on one GPU):"]
    for card, chosen, changes in cards:
        verdict = ("does NOT fit" if not chosen.fits else "fits as configured" if not changes
                   else "fits with " + " ".join(f"--set {change}" for change in changes))
        lines.append(f"  {card:<18} {verdict}")
    return lines


def _halvings(value: int, floor: int) -> int:
    count = 0
    while value >> (count + 1) >= floor:
        count += 1
    return count


def _changes(shape: RunShape, chosen: RunShape) -> list[str]:
    fields = {"backend": "generation.backend", "use_4bit": "model.use_4bit",
              "gradient_checkpointing": "model.gradient_checkpointing", "episodes": "generation.max_concurrent_episodes",
              "micro_batch_tokens": "ppo.micro_batch_tokens"}
    return [f"{key}={str(getattr(chosen, name)).lower() if isinstance(getattr(chosen, name), bool) else getattr(chosen, name)}"
            for name, key in fields.items() if getattr(chosen, name) != getattr(shape, name)]


def describe(plan_: Plan, model_name: str) -> list[str]:
    lines = [f"memory plan for {model_name} on a {plan_.gpu_bytes / GB:.0f} GB GPU:"]
    for owner, terms, total in (("trainer", plan_.trainer, plan_.trainer_bytes),
                                ("vLLM", plan_.vllm, plan_.vllm_bytes)):
        if not terms:
            continue
        lines.append(f"  {owner}: {total / GB:.1f} GB")
        lines += [f"    {t.name:<34} {t.bytes / GB:8.2f} GB  {t.note}" for t in terms]
    total = plan_.trainer_bytes + plan_.vllm_bytes
    verdict = "fits" if plan_.fits else "does NOT fit"
    lines.append(f"  total {total / GB:.1f} GB of {plan_.gpu_bytes / GB:.0f} GB: {verdict} (in {HEADROOM:.0%} of it)")
    if plan_.vllm:
        lines.append(f"  vLLM --gpu-memory-utilization {plan_.vllm_share:.2f}")
    return lines
