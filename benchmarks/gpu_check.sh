#!/usr/bin/env bash
# The checks that need a CUDA GPU (issue #31: "the same paths run with --device cuda"), as one
# prepared command for a machine with a GPU and no network.
#
#   bash benchmarks/gpu_check.sh download
#       here, with the package index reachable: the Python 3.12 wheels of what a stock
#       PyTorch image lacks (mergekit, pydantic, datasets and their small needs), in the
#       versions this venv holds, into .whl/ (git-ignored; about 4 MB).
#   bash benchmarks/gpu_check.sh
#       there, from the repository root with .whl/ beside it: installs the wheels into a
#       private folder (no network), then runs
#         1. every test that skips without a GPU (passes, Grams and solves on CUDA against
#            the CPU's), and
#         2. the 8B-width probe (benchmarks/probes/llm_width.py) at K = 2 and 4 with
#            --device cuda: per-block time, solve time, peak GPU memory.
#       Output: env.txt, cuda_tests.txt, llm_width_cuda.txt and .json under $OUT (else
#       ./gpu_check_out). About 1 minute for the tests and 5 for the probe on one H100.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=.whl

if [ "${1:-}" = download ]; then
    # pydantic-core must match pydantic exactly: both as this venv holds them
    pins=$("$python" - <<'EOF'
import importlib.metadata as m
names = ["mergekit", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         "immutables", "datasets", "dill", "multiprocess"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))
EOF
    ) || exit 1
    platforms=()
    for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    # shellcheck disable=SC2086  # the pins are words
    exec "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$wheels" $pins
fi

out=${OUT:-gpu_check_out}
mkdir -p "$out"
site=/tmp/mergekit-ext-site
export PYTHONPATH="$PWD"
if compgen -G "$wheels/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$PWD:$site"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" -c "import torch, transformers, mergekit_ext; print('torch', torch.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/env.txt" || status=1
# -rs lists what still skipped, and why (two GPUs for NCCL, say)
timeout 300 "$python" -m pytest -q -p no:cacheprovider -rs -k "cuda or tensor_cores" \
    tests/test_device_placement.py tests/test_compute_dtype.py tests/test_bf16_products.py \
    tests/test_executor.py tests/test_distributed.py 2>&1 | tee "$out/cuda_tests.txt" || status=1
timeout 420 "$python" -m benchmarks.probes.llm_width --device cuda --experts 2 4 --threads 8 \
    --methods chain_of_merges --compute-dtype bfloat16 --min-available-gb 20 \
    --json "$out/llm_width_cuda.json" 2>&1 | tee "$out/llm_width_cuda.txt" || status=1
exit $status
