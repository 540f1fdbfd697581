"""merge.py at a size it must stream: peak resident memory and wall time of merging a random adapter (r 8 on every
attention and MLP projection) into a bfloat16 Llama of `--layers` layers of ~103 MB, one shard a layer, in a fresh
process, beside the model's and the largest shard's size and the interpreter's own peak (imports alone).

    OMP_NUM_THREADS=1 python -m bench.merge_memory --layers 8
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ppo_affine.testing.sharded import ROOT, merge_peak, write_random_adapter, write_sharded_release

GB = 1e9


def imports_peak() -> int:
    """Peak resident bytes of a process that only imports what merge.py needs."""
    program = ("import resource, merge, peft, transformers, safetensors, bitsandbytes; "
               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    return int(subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="layers, one shard each (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        base = write_sharded_release(Path(work) / "base", args.layers)
        adapter = write_random_adapter(base, Path(work) / "adapter")
        shards = [f.stat().st_size for f in base.glob("*.safetensors")]
        adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
        peak, seconds, _ = merge_peak(base, adapter, Path(work) / "merged")
    print(json.dumps({"model_gb": round(sum(shards) / GB, 3), "shards": len(shards),
                      "largest_shard_gb": round(max(shards) / GB, 3),
                      "adapter_gb": round(adapter_bytes / GB, 4),
                      "merge_peak_gb": round(peak / GB, 3), "imports_peak_gb": round(imports_peak() / GB, 3),
                      "merge_seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
