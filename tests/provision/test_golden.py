"""Golden files: what the gateway's provisioning writes, byte for byte.

Fixed inputs: a fake /sys (tests/provision/conftest.py), the host name and
the hash_key seam. The golden tree under golden/<case>/ holds the rendered
configuration, the sysctl.d files, the sysusers/tmpfiles files and the units
as installed, and tree.txt: every path written (but /opt/hpclb) with its type,
mode and owner. After an intended change: UPDATE_GOLDEN=1 pytest
tests/provision/test_golden.py, and review the diff.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.provision.conftest import NAME, REPO

GOLDEN = Path(__file__).parent / "golden"
#: The files compared by content (globs under the root); keys, passwd and
#: shadow are random or dated and only listed in tree.txt.
CONTENT = ("etc/hpclb/hpclb.yaml", "etc/sysctl.d/*", "usr/lib/sysusers.d/*",
           "usr/lib/tmpfiles.d/*", "etc/systemd/system/*.service", "etc/passwd", "etc/group")
CASES = {
    # gateway.yaml on a two-socket host with three PCI NICs: DPDK, bound ports.
    "gateway-dpdk": ("appliance/examples/gateway.yaml", ["--dataplane", "dpdk"], True),
    # nat.yaml, XDP: forwarding on for NAT; no host facts (--root without --sysfs).
    "nat-xdp": ("appliance/examples/nat.yaml", ["--dataplane", "xdp"], False),
}


def _names(root: Path, db: str) -> dict[int, str]:
    out = {0: "root"}
    path = root / "etc" / db
    for line in path.read_text().splitlines() if path.exists() else ():
        parts = line.split(":")
        out[int(parts[2])] = parts[0]
    return out


def _tree(root: Path) -> str:
    users, groups = _names(root, "passwd"), _names(root, "group")
    lines = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] == "opt":
            continue
        st = path.lstat()
        kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
        extra = f" -> {os.readlink(path)}" if kind == "l" else ""
        owner = f"{users.get(st.st_uid, st.st_uid)}:{groups.get(st.st_gid, st.st_gid)}"
        lines.append(f"{kind} {stat.S_IMODE(st.st_mode):04o} {owner} /{rel}{extra}")
    return "\n".join(lines) + "\n"


def _rendered(root: Path) -> dict[str, bytes]:
    out = {"tree.txt": _tree(root).encode()}
    for pattern in CONTENT:
        for path in sorted(root.glob(pattern)):
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, provision, root: Path, sysfs: Path) -> None:
    example, flags, with_sysfs = CASES[case]
    args = ["gateway", "--root", str(root), "--name", NAME, "--config", str(REPO / example),
            *flags, *(["--sysfs", str(sysfs)] if with_sysfs else [])]
    result = provision(*args)
    assert result.rc == 0, result.err
    got = _rendered(root)
    where = GOLDEN / case
    if os.environ.get("UPDATE_GOLDEN") == "1":
        shutil.rmtree(where, ignore_errors=True)
        for rel, content in got.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(content)
        return
    assert where.is_dir(), f"no golden files for {case}: run with UPDATE_GOLDEN=1"
    expected = {str(p.relative_to(where)): p.read_bytes()
                for p in sorted(where.rglob("*")) if p.is_file()}
    assert sorted(got) == sorted(expected), "a file appeared or disappeared"
    for rel in sorted(got):
        assert got[rel].decode() == expected[rel].decode(), \
            f"{rel} differs from {where / rel} (UPDATE_GOLDEN=1 after an intended change)"
