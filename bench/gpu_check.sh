#!/usr/bin/env bash
# Issue 6's GPU measurements in one go, for a session lent a GPU (the device tool's `run`
# executes this from the repo root; results land in $OUT, or ./gpu_out without it).
#   part 1: bash bench/gpu_check.sh tests     (GPU-only tests: mgpu kernel, ragged dispatch)
#   part 2: bash bench/gpu_check.sh tune      (Hopper tile autotune -> kernels/mgpu_tiles.json)
#   part 3: bash bench/gpu_check.sh gmm       (bench/gmm.py, full shapes, bf16)
#   part 4: bash bench/gpu_check.sh layer     (bench/moe_layer.py, both proxies)
#   part 5: bash bench/gpu_check.sh mfu       (bench/step_mfu.py: one Mixtral layer's train step)
#   part 6: bash bench/gpu_check.sh peak      (bench/gpu_peak.py: a step's measured peak memory
#           against XLA:GPU's deviceless prediction; the --target=h100 proof compile)
# Each part stays well inside one 10-minute call; run them as separate calls.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
{ nvidia-smi -L; python -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  > "$out/device.txt" 2>&1
case "${1:-}" in
  tests) python -m pytest -q -rs tests/test_gmm.py tests/test_dispatch.py -k "mgpu or ragged" \
           2>&1 | tee "$out/tests.txt" ;;
  tune)  python bench/gmm.py --autotune --shapes=mixtral,deepseek 2>&1 | tee "$out/autotune.txt"
         cp kernels/mgpu_tiles.json "$out/" ;;
  gmm)   python bench/gmm.py 2>&1 | tee "$out/gmm.txt" ;;
  layer) python bench/moe_layer.py 2>&1 | tee "$out/moe_layer.txt" ;;
  mfu)   for extra in "--gmm=ragged_dot" "--gmm=mgpu" "--gmm=mgpu --attention=cudnn"; do
           python bench/step_mfu.py --model=mixtral-8x7b --layers=1 --seq=4096 --batch=2 $extra
         done 2>&1 | tee "$out/mfu.txt" ;;
  peak)  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.97   # jax's default 0.75 cannot hold the step
         for mode in device deviceless cpu; do
           timeout 240 python bench/gpu_peak.py --mode=$mode 2>"$out/peak-$mode.err"
         done | tee "$out/peak.jsonl"
         timeout 200 python run.py --strategy=ep --model=mixtral-8x7b --layers=2 --devices=64 \
           --mesh=fsdp:8,expert:8 --compile_only --dtype=bfloat16 --remat=block --target=h100 \
           2>&1 | tee "$out/target-h100.txt" ;;
  *)     echo "usage: bash bench/gpu_check.sh tests|tune|gmm|layer|mfu|peak" >&2; exit 2 ;;
esac
