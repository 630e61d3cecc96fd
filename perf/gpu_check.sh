#!/usr/bin/env bash
# perf/gpu_check.sh - on a machine with an NVIDIA GPU: does the agent's NVML reader work?
#
# Creates a virtual environment, installs hpclb into it, prints one telemetry
# message as JSON (hpclb-agent sample: GPU list with memory, utilisation and NUMA
# node), a one-line summary per GPU, and exits non-zero if NVML found no GPU.
#
#   perf/gpu_check.sh                  # uses PyPI
#   WHEELHOUSE=DIR perf/gpu_check.sh   # offline: wheels made elsewhere with
#                                      #   pip download -d DIR . (same Python/platform)
# Without network or wheels, the environment falls back on the system's packages.
# PYTHON (default python3) and VENV (default: a fresh temporary directory) may be set.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-$(mktemp -d)/venv}

nvidia-smi -L || echo "gpu_check: nvidia-smi missing or failing; NVML decides" >&2
"$PY" -m venv --system-site-packages "$VENV"
pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
  "${pip[@]}" --no-index --find-links "$WHEELHOUSE" .
elif ! "${pip[@]}" .; then
  echo "gpu_check: pip install failed (offline?): retrying on the system's packages" >&2
  "${pip[@]}" --no-deps --no-build-isolation .
fi

out=$(mktemp)
rc=0
"$VENV/bin/hpclb-agent" --log-level info sample --node-id gpu-check --window 1 \
  --require-gpu >"$out" || rc=$?
cat "$out"
"$VENV/bin/python" - "$out" <<'EOF'
import json, sys
msg = json.load(open(sys.argv[1]))
for g in msg["gpus"]:
    print(f"GPU {g['index']} {g['name']}: {g['mem_used'] / 2**30:.1f}/"
          f"{g['mem_total'] / 2**30:.1f} GiB, util {g['util']}, NUMA node {g['numa_node']}"
          f" (host has {msg['numa_nodes']})")
print(f"gpu_check: {len(msg['gpus'])} GPU(s)")
EOF
rm -f "$out"
exit "$rc"
