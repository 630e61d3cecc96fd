"""The sysctls each mode needs: one file per role, every setting documented,
written to a fake /proc/sys when live."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.provision import sysctls
from hpclb.provision.plan import Context, ProvisionError, run_plan

DSR_VIP = {"name": "web", "address": "192.0.2.10", "port": 80, "pool": "p"}
NAT_VIP = {**DSR_VIP, "name": "nat", "mode": "nat"}
NAT6_VIP = {**NAT_VIP, "name": "nat6", "address": "2001:db8::10"}
TUNNEL_VIP = {**DSR_VIP, "name": "tun", "mode": "tunnel"}


def keys(settings: list[sysctls.Sysctl]) -> dict[str, str]:
    return {s.key: s.value for s in settings}


def test_gateway_forwards_only_for_nat() -> None:
    dsr = keys(sysctls.gateway_sysctls({"vips": [DSR_VIP]}))
    assert dsr == {"net.ipv4.conf.all.rp_filter": "2", "net.ipv4.conf.default.rp_filter": "2"}
    nat = keys(sysctls.gateway_sysctls({"vips": [DSR_VIP, NAT_VIP]}))
    assert nat["net.ipv4.ip_forward"] == "1" and "net.ipv6.conf.all.forwarding" not in nat
    nat6 = keys(sysctls.gateway_sysctls({"vips": [NAT6_VIP]}))
    assert nat6["net.ipv6.conf.all.forwarding"] == "1" and "net.ipv4.ip_forward" not in nat6
    assert keys(sysctls.gateway_sysctls(None)) == dsr


def test_backends_arp_for_dsr_and_tunnel_nothing_for_nat() -> None:
    for modes in (["dsr"], ["tunnel"], ["nat", "dsr"]):
        got = keys(sysctls.backend_sysctls(modes))
        assert got == {"net.ipv4.conf.all.arp_ignore": "1", "net.ipv4.conf.all.arp_announce": "2",
                       "net.ipv4.conf.all.rp_filter": "2",
                       "net.ipv4.conf.default.rp_filter": "2"}
    assert sysctls.backend_sysctls(["nat"]) == [] and sysctls.backend_sysctls([]) == []


@pytest.mark.parametrize("settings", [
    sysctls.gateway_sysctls({"vips": [NAT_VIP, NAT6_VIP]}),
    sysctls.backend_sysctls(["dsr"]),
    [],
])
def test_every_setting_is_documented(settings: list[sysctls.Sysctl]) -> None:
    text = sysctls.render("gateway", settings)
    lines = text.splitlines()
    values = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    assert len(values) == len(settings)
    for i in values:
        assert lines[i - 1].startswith("# ")  # its reason, right above it
        assert all(len(line) <= 80 for line in lines)
    if not settings:
        assert "Nothing to set" in text
    assert text.endswith("\n")


def fake_proc(tmp_path: Path, values: dict[str, str]) -> Path:
    proc = tmp_path / "proc"
    for key, value in values.items():
        path = sysctls.proc_path(proc, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return proc


def ctx(tmp_path: Path, *, live: bool = True, check: bool = False) -> Context:
    return Context(root=tmp_path / "root", live=live, check=check, src=tmp_path,
                   out=lambda line: None)


def test_node_file_and_live_values(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {"net.ipv4.conf.all.arp_ignore": "0",
                                "net.ipv4.conf.all.arp_announce": "0",
                                "net.ipv4.conf.all.rp_filter": "1",
                                "net.ipv4.conf.default.rp_filter": "2"})
    acts = sysctls.actions(ctx(tmp_path), "node", {"vips": [DSR_VIP]}, proc=proc)
    checked = ctx(tmp_path, check=True)
    assert run_plan(acts, checked) == 2
    assert (sysctls.proc_path(proc, "net.ipv4.conf.all.arp_ignore").read_text() == "0\n")
    c = ctx(tmp_path)
    assert run_plan(acts, c) == 2
    conf = tmp_path / "root/etc/sysctl.d/60-hpclb-node.conf"
    assert "net.ipv4.conf.all.arp_ignore = 1" in conf.read_text()
    assert sysctls.proc_path(proc, "net.ipv4.conf.all.arp_announce").read_text() == "2\n"
    live = next(line for line in c.lines if line.startswith("changed: kernel settings"))
    assert "net.ipv4.conf.all.rp_filter 1 -> 2" in live
    assert "default.rp_filter" not in live  # already 2
    again = ctx(tmp_path)
    assert run_plan(acts, again) == 0 and again.lines == ["provision: no change"]


def test_root_writes_the_file_only(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {"net.ipv4.ip_forward": "0"})
    acts = sysctls.actions(ctx(tmp_path), "gateway", {"vips": [NAT_VIP]}, proc=proc)
    rooted = ctx(tmp_path, live=False)
    assert run_plan(acts, rooted) == 1
    assert "skipped (--root): kernel settings now (/proc/sys)" in rooted.lines
    assert sysctls.proc_path(proc, "net.ipv4.ip_forward").read_text() == "0\n"
    text = (tmp_path / "root/etc/sysctl.d/60-hpclb-gateway.conf").read_text()
    assert "net.ipv4.ip_forward = 1" in text
    assert sysctls.actions(ctx(tmp_path), "client", {"vips": [NAT_VIP]}) == []


def test_a_setting_this_kernel_lacks_is_an_error_before_any_change(tmp_path: Path) -> None:
    # IPv6 NAT VIPs on a kernel booted with ipv6.disable=1: no net/ipv6 in /proc/sys.
    proc = fake_proc(tmp_path, {"net.ipv4.ip_forward": "0", "net.ipv4.conf.all.rp_filter": "0",
                                "net.ipv4.conf.default.rp_filter": "0"})
    acts = sysctls.actions(ctx(tmp_path), "gateway", {"vips": [NAT_VIP, NAT6_VIP]}, proc=proc)
    with pytest.raises(ProvisionError, match=r"all\.forwarding: not on this kernel"):
        run_plan(acts, ctx(tmp_path))
    assert not (tmp_path / "root").exists()
    assert sysctls.proc_path(proc, "net.ipv4.ip_forward").read_text() == "0\n"
