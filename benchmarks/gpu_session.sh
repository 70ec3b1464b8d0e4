#!/usr/bin/env bash
# One lent GPU, one call: install the carried wheels (hivemind and what a PyTorch image lacks, see
# docs/gpu-servers.md "Bringing hivemind to a server without a package index"), probe which collectives gloo
# serves for GPU tensors (benchmarks/gloo_cuda_probe.py), then run the whole-run cases of benchmarks/gpu_run.py,
# the most wanted first, each with its own timeout, so that a call cut short keeps what it measured.  Results go
# to $OUT (probe.json, results.json, results.md, stdout.txt, runs.tgz).
#
#   bash benchmarks/gpu_session.sh [CASES] [SECONDS] [INNER_STEPS]
#
# CASES defaults to the islands whose ranks share the GPU (gloo on CUDA tensors), with the single process of the
# same model beside them, at INNER_STEPS 15 (they step ~1% as fast); named cases run at H = 100, as measured
# before, unless INNER_STEPS says otherwise.  SECONDS (default 440) bounds the cases.  Carry the wheels folder
# (.whl) with the call.
set -o pipefail
cases=${1:-150m-pp2-one-gpu,tiny-outer-on-gpu-serves-a-joiner,150m-dp2-one-gpu,150m-tp2-one-gpu,150m-delayed,150m-dp2-tp2-one-gpu,150m-2-tp2-islands-hivemind}
seconds=${2:-440}
if [ -z "$1" ]; then inner=${3:-15}; else inner=${3:-100}; fi
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "the wheels in .whl did not install: carry the folder (see docs/gpu-servers.md)"; exit 1; }
chmod +x /tmp/site/hivemind/hivemind_cli/p2pd
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 60 python3 benchmarks/gloo_cuda_probe.py --timeout 40 --out "$out" 2>&1 | tee "$out/probe.txt"
timeout "$seconds" python3 benchmarks/gpu_run.py --cases "$cases" --inner-steps "$inner" --rounds 3 \
  --case-timeout 100 --out /tmp/gr 2>&1 | tee "$out/stdout.txt"
cp /tmp/gr/results.* "$out/" 2>/dev/null
tar czf "$out/runs.tgz" --exclude='*.key' --exclude='*.pt' --exclude='*.safetensors' -C /tmp/gr runs
