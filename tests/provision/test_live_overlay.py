"""The gateway's plan run live (root "/", not --root) without touching the host.

The live path differs from --root: systemd-sysusers/-tmpfiles and systemctl
act on "/", the kernel settings are written to /proc/sys, and where systemd is
not running the plan says so and stops. It runs here inside a private mount
namespace, chrooted into an overlay of the host's own / (its real passwd, its
units), in a fresh network namespace (the net.* sysctls it writes are that
namespace's); everything is discarded afterwards. What stays untried: apt,
the venv and make (provision.sh's bash steps), systemd starting the units,
hugepages and vfio binding (an XDP configuration: vagrant.yaml).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.provision.conftest import HASH_KEY, REPO

SCRIPT = r"""
set -euo pipefail
T=$1 REPO=$2
mount --make-rprivate /
mount -t overlay overlay -o "lowerdir=/,upperdir=$T/upper,workdir=$T/work" "$T/m"
mount -t proc proc "$T/m/proc"
mount -t sysfs -o ro sysfs "$T/m/sys"
mount --rbind /dev "$T/m/dev"
mount -t tmpfs tmpfs "$T/m/run"
mount -t tmpfs tmpfs "$T/m/tmp"
# A checkout under /tmp or /run (CI's clean clone) is hidden by those tmpfs:
# shown again, read-only, at its own path.
case "$REPO" in
  /tmp/*|/run/*) mkdir -p "$T/m$REPO"; mount --bind "$REPO" "$T/m$REPO"
                 mount -o remount,bind,ro "$T/m$REPO" ;;
esac
ip link set lo up
# vagrant.yaml's data ports (XDP: nothing is bound), in this namespace only.
ip link add eth2 type veth peer name eth3
run() {
  chroot "$T/m" env PYTHONPATH="$REPO/control" HPCLB_PROVISION_TEST_HASH_KEY="$HASH_KEY" \
    "$REPO/.venv/bin/python" -m hpclb.provision gateway --src "$REPO" --name gwlive \
    --config "$REPO/appliance/examples/vagrant.yaml"
}
echo "== run 1"; run
echo "== run 2"; run
echo "== passwd"; chroot "$T/m" getent passwd hpclb
echo "== rp_filter $(cat /proc/sys/net/ipv4/conf/all/rp_filter)"
"""


def _host_state() -> dict[str, object]:
    return {p: os.path.lexists(p) for p in (
        "/etc/hpclb", "/usr/lib/sysusers.d/hpclb.conf", "/usr/local/bin/hpclb",
        "/etc/sysctl.d/60-hpclb-gateway.conf", "/etc/systemd/system/hpclb.service")} | {
        "passwd": Path("/etc/passwd").read_bytes(),
        "rp_filter": Path("/proc/sys/net/ipv4/conf/all/rp_filter").read_text()}


def test_gateway_live_in_an_overlay_of_this_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount namespace, overlayfs, chroot)")
    for tool in ("unshare", "chroot", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    # The overlay shows /'s own file system only, not what is mounted on it.
    root_dev = os.stat("/").st_dev
    for needed in (REPO, (REPO / ".venv/bin/python").resolve()):
        if os.stat(needed).st_dev != root_dev:
            pytest.skip(f"{needed} is not on the root file system: the overlay would not show it")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm for the overlay's upper layer")
    # The overlay's upper layer must not sit on the lower file system (/).
    tmp = Path(tempfile.mkdtemp(prefix="hpclb-live.", dir="/dev/shm"))
    before = _host_state()
    try:
        for d in ("upper", "work", "m"):
            (tmp / d).mkdir()
        proc = subprocess.run(
            ["unshare", "--mount", "--net", "--fork", "bash", "-c", SCRIPT, "bash",
             str(tmp), str(REPO)], env={**os.environ, "HASH_KEY": HASH_KEY},
            capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0 and proc.stdout == "" and (
                "unshare failed" in proc.stderr or "overlay" in proc.stderr):
            pytest.skip(f"no mount namespace or overlayfs here: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = proc.stdout.split("== ")
    first, second = out[1].splitlines(), out[2].splitlines()
    assert "changed: users from /usr/lib/sysusers.d/hpclb.conf: install " \
           "/usr/lib/sysusers.d/hpclb.conf; user hpclb" in first
    assert any(line.startswith("changed: kernel settings now (/proc/sys): ") for line in first)
    assert any(line.startswith("changed: enable hpclb.service: ") for line in first)
    if not Path("/run/systemd/system").is_dir():  # the chroot's /run is empty anyway
        assert any(line.startswith("systemd is not running") and line.endswith("stopping here")
                   for line in first)
    assert second[-1] == "provision: no change"
    assert out[3].startswith("passwd\nhpclb:x:")
    assert out[4].strip() == "rp_filter 2"
    assert _host_state() == before  # nothing of it reached the host
