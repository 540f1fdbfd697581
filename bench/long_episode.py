"""A long agent episode through the local decode loop, every turn's prompt prefilled whole (`reuse_kv_cache` off)
beside every turn continued from the cache the last one kept, one episode after the other in one run: per turn the
prompt's length, the tokens prefilled, the seconds of prefill and of decode, and the whole turn's.

The model is built from its config with random weights straight into memory (bench/random_model_step.py's loader),
so a lent GPU can run Qwen3.6-35B-A3B at its real size; the tokenizer is the tiny test tokenizer (its ids lie inside
any vocabulary). Replies are scripted (reasoning, then an answer, ~40 tokens; the model still runs every token), so
both episodes see the same conversation: the history resent without the replies' reasoning, observations as tool and
as user messages, grown to about --final-tokens by the last turn (ppo_affine/testing/agent_episode.py).

    python -m bench.long_episode --model tiny-real-vocab --turns 30 --final-tokens 16384     # CPU, a few minutes
    python -m bench.long_episode --model qwen3.6-35b-a3b --device cuda --turns 4 --final-tokens 32768  # a lent H200
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.random_model_step import model_config, random_model_loader
from ppo_affine.config import GenerationConfig, LoraConfig, ModelConfig
from ppo_affine.testing.agent_episode import CHAT_TEMPLATE, ScriptedReasoning, converse, observation, reasoning_stripped
from ppo_affine.testing.tiny import make_tokenizer, tiny_architecture_config

REAL_VOCAB = 248320  # Qwen3.6's
MODELS = ("tiny", "tiny-real-vocab", "qwen3.6-35b-a3b")  # tiny: the tiny tokenizer's vocabulary (tests)
MODES = {"reprefill": False, "continue": True}  # generation.reuse_kv_cache


class TimedTurns(ScriptedReasoning):
    """Scripted replies; each prefill and decode step timed (after a device sync on CUDA: a bench, not the loop)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_s = self.decode_s = 0.0

    def _timed(self, call, *args):
        sync = torch.cuda.synchronize if self.policy.device.type == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        result = call(*args)
        sync()
        return result, time.perf_counter() - started

    def _forward_in_chunks(self, *args):
        result, seconds = self._timed(super()._forward_in_chunks, *args)
        self.prefill_s += seconds
        return result

    def _decode_step(self, *args):
        _, seconds = self._timed(super()._decode_step, *args)
        self.decode_s += seconds


def build_policy(name: str, device: torch.device, folder: Path):
    """The model of `name`, random weights built on `device` (float32 on CPU, bf16 on CUDA), LoRA as the trainer's."""
    from transformers import AutoModelForCausalLM

    from ppo_affine.policy import load_policy

    tokenizer = make_tokenizer()
    if name.startswith("tiny"):
        vocab = REAL_VOCAB if name == "tiny-real-vocab" else len(tokenizer)
        config = tiny_architecture_config("qwen3_5_moe_text", vocab, tokenizer.pad_token_id, tokenizer.eos_token_id)
    else:
        config = model_config(name)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    original = AutoModelForCausalLM.from_pretrained
    AutoModelForCausalLM.from_pretrained = random_model_loader(config, device, use_4bit=False)
    try:
        policy = load_policy(ModelConfig(name_or_path=str(folder), use_4bit=False, dtype=dtype,
                                         gradient_checkpointing=False), LoraConfig(), device)
    finally:
        AutoModelForCausalLM.from_pretrained = original
    policy.tokenizer.chat_template = CHAT_TEMPLATE
    return policy


def observation_lines(tokenizer, turns: int, final_tokens: int) -> int:
    """Lines of each observation so that the episode's last prompt is about `final_tokens` long (each turn adds an
    observation and ~30 tokens of answer and message markers)."""
    per_line = len(tokenizer.encode(observation(0, 100)["content"], add_special_tokens=False)) / 100
    return max(1, round((final_tokens / turns - 30) / per_line))


def play(policy, mode: str, turns: int, lines: int, device: torch.device) -> dict:
    cfg = GenerationConfig(backend="local", max_new_tokens=64, temperature=1.0, reuse_kv_cache=MODES[mode])
    generator = TimedTurns(policy, cfg, seed=0)
    rows, marks = [], {"prefilled": 0, "prefill_s": 0.0, "decode_s": 0.0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def on_turn(turn: int, prompt: list[int], seconds: float) -> None:
        now = {"prefilled": generator.prefilled_tokens, "prefill_s": generator.prefill_s,
               "decode_s": generator.decode_s}
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "prefilled": now["prefilled"] - marks["prefilled"],
                     "prefill_s": round(now["prefill_s"] - marks["prefill_s"], 4),
                     "decode_s": round(now["decode_s"] - marks["decode_s"], 4), "turn_s": round(seconds, 4)})
        marks.update(now)
    started = time.perf_counter()
    _, _, final = converse(generator, turns, reasoning_stripped, lines, on_turn)
    return {"mode": mode, "final_tokens": final, "prefilled_tokens": generator.prefilled_tokens,
            "prefilled_over_final": round(generator.prefilled_tokens / final, 3),
            "prefix_break_rate": generator.prefix_break_rate(), "wall_s": round(time.perf_counter() - started, 2),
            "prefill_s": round(generator.prefill_s, 3), "decode_s": round(generator.decode_s, 3),
            "peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "turns": rows}


def run(args) -> dict:
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        policy = build_policy(args.model, device, Path(work))
        built = time.perf_counter() - started
    lines = observation_lines(policy.tokenizer, args.turns, args.final_tokens)
    episodes = [play(policy, mode, args.turns, lines, device) for mode in args.modes]
    return {"model": args.model, "device": args.device, "turns": args.turns, "observation_lines": lines,
            "build_s": round(built, 1), "episodes": episodes}


def table(result: dict) -> str:
    episodes = result["episodes"]
    head = "turn  prompt " + "".join(f"| {e['mode']:>9} prefilled  prefill_s  decode_s  turn_s " for e in episodes)
    lines = [head]
    for turn in range(result["turns"]):
        rows = [e["turns"][turn] for e in episodes]
        lines.append(f"{turn:>4} {rows[0]['prompt_tokens']:>7} " + "".join(
            f"| {r['prefilled']:>19} {r['prefill_s']:>10.3f} {r['decode_s']:>9.3f} {r['turn_s']:>7.3f} " for r in rows))
    for e in episodes:
        lines.append(f"{e['mode']}: prefilled {e['prefilled_tokens']} for a final length of {e['final_tokens']} "
                     f"({e['prefilled_over_final']}x), prefill {e['prefill_s']} s, decode {e['decode_s']} s, "
                     f"episode {e['wall_s']} s, prefix breaks {e['prefix_break_rate']:.2f}, peak {e['peak_gb']} GB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="tiny-real-vocab")
    parser.add_argument("--device", default="cpu", help="cuda on a lent GPU (default: cpu)")
    parser.add_argument("--turns", type=int, default=30, help="turns of the episode (default: 30)")
    parser.add_argument("--final-tokens", type=int, default=16384,
                        help="about the last prompt's length (default: 16384)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="reprefill: every prompt whole; continue: from the last turn's cache (default: both)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "episodes"} | {
        "episodes": [{k: v for k, v in e.items() if k != "turns"} for e in result["episodes"]]}), flush=True)


if __name__ == "__main__":
    main()
