"""Does the engine apply LoRA adapters? One check for every program that has a vLLM server generate with an adapter.

Engines have had LoRA bugs on the very models this trains (the adapter silently dropped, in whole or in part): a run
would then learn from base-model samples, an evaluation would score the base model under the adapter's name. The
check loads a probe adapter (the adapter's own layers, their B matrices drawn at random and scaled until they move
the next-token log-probs by PROBE_SHIFT nats) into the server, samples a few tokens with it, and compares the
server's log-probs of them with the local model's (`VLLMGenerator.check_adapter_applied`: a VLLMError naming the
likely upstream bug where they are the base model's). train_ppo.py runs it with its policy before the first sample;
evaluate.py (and its --env-evaluate path) before the first episode of an adapter it evaluates through a server, on
the adapter loaded locally for it (the base model loaded once on run.device, freed after), as it loads the adapter
into the server (`serve_evaluated_adapter`).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ppo_affine.file_writes import writing
from ppo_affine.generation import PROBE_TEXT
from ppo_affine.seeds import derive_seed


async def check_engine_applies_adapters(policy, generator, folder: Path):
    """Save a probe adapter of `policy`'s own adapter layers in `folder`, have `generator` (a VLLMGenerator or
    VLLMServers) load and sample with it, and compare log-probs; the folder is removed after. Returns the reading(s);
    a VLLMError when the server's log-probs are the base model's."""
    prompt = policy.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    shutil.rmtree(folder, ignore_errors=True)
    with policy.probe_adapter(prompt):
        with writing("the probe adapter for vLLM", folder):
            policy.model.save_pretrained(folder, selected_adapters=["default"])

        def trainer_logprobs(tokens: list[int]) -> tuple[list[float], list[float]]:
            with policy.base():
                base = policy.token_logprobs(prompt, tokens).tolist()
            return base, policy.token_logprobs(prompt, tokens).tolist()

        try:
            return await generator.check_adapter_applied(folder, prompt, trainer_logprobs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


async def check_evaluated_adapter(config, generator, adapter_dir: Path):
    """The check for an evaluation: the adapter in `adapter_dir` on its base, loaded locally on run.device for the
    probe alone (freed after), its probe loaded into the server behind `generator`."""
    import torch

    from ppo_affine.model_files import load_adapter_model, load_base_model, load_tokenizer, pick_device
    from ppo_affine.policy import Policy

    model_cfg = config.train.model
    device = pick_device(config.train.run.device)
    model = load_adapter_model(load_base_model(model_cfg, device), Path(adapter_dir), model_cfg.name_or_path)
    policy = Policy(model, load_tokenizer(model_cfg)).eval()
    try:
        with tempfile.TemporaryDirectory(prefix="adapter-probe-") as folder:
            return await check_engine_applies_adapters(policy, generator, Path(folder) / "probe")
    finally:
        del policy, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


async def serve_evaluated_adapter(config, generator, adapter_dir: Path) -> str:
    """An evaluated adapter loaded into the server behind `generator` under a name of its own folder, probed first
    where generation.check_adapter asks (an engine that drops adapters would have the base scored under the
    adapter's name); the name requests give to play it."""
    if config.train.generation.check_adapter:
        await check_evaluated_adapter(config, generator, adapter_dir)
    return await generator.load_adapter(adapter_dir, f"eval-{derive_seed(Path(adapter_dir).resolve()):08x}")
