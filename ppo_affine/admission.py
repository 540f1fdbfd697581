"""The Affine validators' admission check of a submitted model folder, as their public checker does it (mid-2026).

A `config.json` is admitted when it carries no `quantization_config` and its model type and sizes equal one
admitted entry exactly; for the multimodal Qwen3.6 release the language model's sizes sit under `text_config`.
The network changes this list; it is data here so a new entry is one line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AdmittedModel:
    name: str
    model_type: str
    fields: dict  # field -> value, read from `section` of config.json
    section: str | None = None  # None = top level


ADMITTED = (
    AdmittedModel("Qwen3-32B", "qwen3", dict(
        hidden_size=5120, num_hidden_layers=64, intermediate_size=25600, vocab_size=151936,
        num_attention_heads=64, num_key_value_heads=8)),
    AdmittedModel("Qwen3.6-35B-A3B", "qwen3_5_moe", dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, vocab_size=248320,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512), section="text_config"),
)


def checked_fields(config: dict, entry: AdmittedModel) -> dict:
    """The values of `entry`'s fields in `config` (None where missing)."""
    section = config.get(entry.section, {}) if entry.section else config
    return {name: section.get(name) for name in entry.fields}


def admission(config: dict, admitted: tuple[AdmittedModel, ...] = ADMITTED) -> tuple[str | None, list[str]]:
    """(the admitted model `config` is, None) and why not: one line per reason."""
    if "quantization_config" in config or "quantization_config" in config.get("text_config", {}):
        return None, ["config.json carries a quantization_config: only unquantized models are admitted"]
    entries = [entry for entry in admitted if entry.model_type == config.get("model_type")]
    if not entries:
        return None, [f"model_type {config.get('model_type')!r} is not admitted (admitted: "
                      f"{', '.join(f'{e.model_type} ({e.name})' for e in admitted)})"]
    reasons = []
    for entry in entries:
        found = checked_fields(config, entry)
        wrong = {name: (found[name], want) for name, want in entry.fields.items() if found[name] != want}
        if not wrong:
            return entry.name, []
        where = f"{entry.section}." if entry.section else ""
        reasons.append(f"not {entry.name}: " + ", ".join(f"{where}{name} is {got} (needs {want})"
                                                         for name, (got, want) in wrong.items()))
    return None, reasons


def folder_admission(folder: Path) -> tuple[str | None, list[str]]:
    return admission(json.loads((Path(folder) / "config.json").read_text()))
