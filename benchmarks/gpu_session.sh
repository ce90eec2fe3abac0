#!/usr/bin/env bash
# One lent-GPU session for issue 4 (see docs/PERFORMANCE.md, "GPU apply"): GPU tests, the apply
# benchmark, the trainer benchmark. Logs and the PNG go to $OUT. Run from the repository root.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch, triton, zstandard, fsspec, tqdm, safetensors, numpy, datetime, os
print(datetime.datetime.now(datetime.timezone.utc).isoformat(), torch.cuda.get_device_name(0), "torch", torch.__version__,
      "triton", triton.__version__, "zstandard", zstandard.__version__, "cpus", os.cpu_count())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$OUT/env.log"
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -m gpu tests/apply --maxfail=20 -p no:cacheprovider 2>&1 | tail -n 40 | tee "$OUT/pytest_gpu.log"
echo "pytest: $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/apply_gpu.py --out "$OUT" ${APPLY_ARGS:-} 2>&1 | tail -n 60
echo "apply_gpu: $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${TRAINER_TIMEOUT:-100} python3 benchmarks/trainer_gpu.py --out "$OUT" 2>&1 | tail -n 12
echo "trainer_gpu: $(( $(date +%s) - t0 ))s"
