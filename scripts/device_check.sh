#!/bin/bash
# The GPU check run on a lent H200 (docs/benchmarks.md, "H200"): the CUDA-related test
# files, `aiokv demo` on cuda:0, then `aiokv bench device` over TCP staging and NIXL.
# Needs a Python with a CUDA torch, aiokv's dependencies and (for NIXL) nixl; on a
# machine without a package index, carry them as wheels, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     pydantic pydantic_core pydantic-settings python-dotenv annotated-types \
#     typing-inspection msgspec pytest-asyncio sniffio trio outcome nixl==1.5.1 nixl-cu13==1.5.1
# and aiokv's own wheel (`pip wheel --no-deps -w .whl .`: its pytest plugin's entry point,
# for the suite's plugin tests), then there: pip install --target /tmp/site .whl/*.whl;
# PYTHONPATH=$PWD:/tmp/site (the checkout first: its aiokv is the one tested)
# Writes tests.log and the benches' JSON into $OUT (default: ./device-check).

export PYTHONUNBUFFERED=1
OUT=${OUT:-device-check}; mkdir -p "$OUT"
T0=$(date +%s); BUDGET=${BUDGET:-480}
left() { local l=$(( $1 - ($(date +%s) - T0) )); (( l < 5 )) && l=5; echo $l; }
nvidia-smi -L
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
python3 -c "import nixl._api as a; print('nixl', a.__file__)" 2>&1 | tail -1
echo "== tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --timeout 120 \
  tests/integrations/test_vllm_cuda.py tests/copy/test_device.py tests/copy/test_kernels.py tests/copy/test_cuda_addresses.py \
  tests/remote/test_staging.py tests/remote/test_route.py tests/transport/nixl/test_nixl_vram.py tests/transport/nixl/test_leases.py \
  tests/integrations/test_vllm_worker.py tests/integrations/test_vllm_push.py 2>&1 | tee $OUT/tests.log | tail -40
echo "tests rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "== demo"
timeout 60 python3 -m aiokv.cli demo 2>&1 | tail -15
echo "demo rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
echo "== bench device tcp"
timeout $(left 300) python3 -m aiokv.cli bench device --json > $OUT/device_tcp.json 2>$OUT/device_tcp.err
echo "rc $? at $(( $(date +%s) - T0 )) s"; tail -c 1500 $OUT/device_tcp.json; tail -5 $OUT/device_tcp.err
echo "== bench device nixl"
timeout $(left 420) python3 -m aiokv.cli bench device --backend nixl --json > $OUT/device_nixl.json 2>$OUT/device_nixl.err
echo "rc $? at $(( $(date +%s) - T0 )) s"; tail -c 1500 $OUT/device_nixl.json; tail -5 $OUT/device_nixl.err
echo "== whole suite, -n 8"
OMP_NUM_THREADS=2 timeout $(left $BUDGET) python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 120 tests \
  --ignore=tests/integrations > $OUT/suite.log 2>&1
echo "suite rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^(FAILED|ERROR)" $OUT/suite.log | head -20; tail -3 $OUT/suite.log
