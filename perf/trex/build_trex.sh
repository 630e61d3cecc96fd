#!/usr/bin/env bash
# Build the TRex v3.08 server from a source tree the user provides, on Debian 12.
#
#   perf/trex/build_trex.sh /path/to/trex-core        # a checkout of tag v3.08 (commit e2777369)
#
# TRex's server is in no package registry, so the lab builds it from source. What
# Debian 12 needs over the upstream defaults:
#   * gcc 12 warns where older gcc did not and the waf script builds with -Werror:
#     drop -Werror from gcc_flags in linux_dpdk/ws_main.py.
#   * no Mellanox (needs rdma-core/OFED) nor Broadcom drivers: ./b configure --no-mlx=all --no-bnxt.
#   * --no-old skips the "-o" (non-PIE, older toolchain) targets; the debug build
#     doubles the time and the lab never runs it, so only the release target is built
#     unless TREX_BUILD_DEBUG=1.
# Ends with <src>/scripts/t-rex-64 (the launcher) and <src>/scripts/_t-rex-64 (the
# binary). Build deps (apt): build-essential python3 zlib1g-dev libnuma-dev
# libelf-dev libpcap-dev pkg-config.
set -euo pipefail

src=${1:?usage: build_trex.sh TREX_SOURCE_TREE}
src=$(cd "$src" && pwd)
[[ -x "$src/linux_dpdk/b" && -f "$src/linux_dpdk/ws_main.py" ]] \
    || { echo "build_trex.sh: $src is not a trex-core tree (no linux_dpdk/b)" >&2; exit 2; }

ws="$src/linux_dpdk/ws_main.py"
# Patch in place, idempotently (re-running the script on a patched tree is a no-op).
TREX_BUILD_DEBUG=${TREX_BUILD_DEBUG:-0} python3 - "$ws" <<'PY'
import os
import re
import sys

path = sys.argv[1]
text = open(path).read()
orig = text
# gcc 12 (Debian 12) raises warnings in DPDK/TRex sources that older gcc did not.
text = text.replace("             '-Werror',\n", "")
if os.environ.get("TREX_BUILD_DEBUG") != "1":
    # Build only the release server; the debug one doubles the build time.
    text = re.sub(r"^(\s*)(build_option\(debug_mode= DEBUG_, is_pie = (False|True)\),)$",
                  r"\1# hpclb: release only: \2", text, flags=re.M)
if text != orig:
    open(path, "w").write(text)
    print("build_trex.sh: patched", path)
else:
    print("build_trex.sh:", path, "already patched")
if "'-Werror'," in text.split("REQUIRED_CC_VERSION")[0]:
    sys.exit("build_trex.sh: could not remove -Werror from gcc_flags")
PY

cd "$src/linux_dpdk"
start=$(date +%s)
./b configure --no-mlx=all --no-bnxt
./b build --no-old
end=$(date +%s)

[[ -x "$src/scripts/_t-rex-64" ]] || { echo "build_trex.sh: no scripts/_t-rex-64 after build" >&2; exit 1; }
echo "build_trex.sh: built $src/scripts/_t-rex-64 in $((end - start)) s ($(nproc) cores)"
