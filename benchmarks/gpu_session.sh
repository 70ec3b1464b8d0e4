#!/usr/bin/env bash
# One lent GPU, one call: install the carried wheels (hivemind and what a PyTorch image lacks, see
# docs/gpu-servers.md "Bringing hivemind to a server without a package index"), then run the whole-run cases of
# benchmarks/gpu_run.py, the most wanted first, each with its own timeout, so that a call cut short keeps what
# it measured.  Results go to $OUT (results.json, results.md, stdout.txt, runs.tgz).
#
#   bash benchmarks/gpu_session.sh [CASES] [SECONDS]
#
# CASES defaults to the cases no GPU has measured since the round's host path changed; SECONDS (default 520)
# bounds the whole benchmark.  Carry the wheels folder (.whl) with the call.
set -o pipefail
cases=${1:-1b-delayed-outer-on-gpu,1b-blocking-outer-on-gpu,1b-blocking,150m-delayed,1b-delayed}
seconds=${2:-470}
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "the wheels in .whl did not install: carry the folder (see docs/gpu-servers.md)"; exit 1; }
chmod +x /tmp/site/hivemind/hivemind_cli/p2pd
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "$seconds" python3 benchmarks/gpu_run.py --cases "$cases" --rounds 3 --case-timeout 150 --out /tmp/gr 2>&1 \
  | tee "$out/stdout.txt"
cp /tmp/gr/results.* "$out/" 2>/dev/null
tar czf "$out/runs.tgz" --exclude='*.key' -C /tmp/gr runs
