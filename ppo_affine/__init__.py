"""The engine the programs at the repository root are built from: PPO math, batching, scoring and advantages,
the update, rollouts, generation backends, the policy, checkpoints, ranks, the run log, and the environments."""
import logging


def _not_the_kernels_notice(record: logging.LogRecord) -> bool:
    return "gemm_4bit_forward" not in record.getMessage()


# peft imports bitsandbytes whenever it is installed. On CPUs with AVX512-BF16 bitsandbytes then logs, at import,
# that an optional kernel package (fetched from the Hugging Face Hub) is missing; NF4 runs on its built-in kernels,
# which the policy uses anyway. Set here, before anything can import bitsandbytes, so no program shows the line.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_kernels_notice)
