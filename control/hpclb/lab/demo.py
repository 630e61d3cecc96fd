"""`hpclb demo`: the appliance in the lab, shares against weights, live.

Client, appliance and three backend namespaces on a bridge; `hpclb run` with
the XDP data plane, or the DPDK forwarder (``--dataplane dpdk``: net_af_xdp on
the appliance's veth, its addresses moved to the exception TAP), in DSR mode;
N short TCP connections from the client; the share of each backend printed
next to its configured weight; a weight change by SIGHUP; the shares again.
Everything is torn down at the end, on Ctrl-C and on error.

``--mode nat`` runs the same on the two-network lab (``hpclb.lab.gateway``):
the appliance between the client network and the cluster network, VIPs in
``mode: nat``, backends with nothing on loopback whose default route is the
appliance. A build whose configuration or data plane does not take NAT mode
says so and stops before anything is started.

``--mode tunnel`` runs it on the routed tunnel lab (``hpclb.lab.tunnel``): the
backends on another network behind a router namespace, each decapsulating with
``decap.bpf.o`` (XDP) and holding the VIP on loopback; the VIPs in ``mode:
tunnel``, IPIP over IPv4 (with ``--ipv6``: GUE over IPv6, for an IPv4 and an
IPv6 VIP). ``--ipv6`` alone: the one-LAN lab in dual stack, an IPv6 VIP beside
the IPv4 one, the shares measured on the IPv6 VIP (DSR). ``--mode nat --ipv6``:
the two-network lab in dual stack (``GatewayLab(ipv6=True)``), an IPv6 NAT VIP
beside the IPv4 one, the backends by their cluster-side IPv6 addresses, the shares
measured on the IPv6 VIP; a build whose configuration or data plane has no IPv6
NAT mode (the hello's "nat6") says so and stops.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance, LabApplianceError
from hpclb.lab.gateway import GatewayLab
from hpclb.lab.topology import Lab, default_pass_obj
from hpclb.lab.tunnel import DEFAULT_GUE_PORT, TunnelLab

MODES = ("dsr", "nat", "tunnel")

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}


def _table(title: str, weights: dict[str, float], report: dict) -> None:
    total_w = sum(weights.values())
    ok = max(report["ok"], 1)
    print(f"\n{title}: {report['ok']} of {report['connections']} connections answered "
          f"({report['failures']} failed) in {report['elapsed_s']:.1f}s")
    print(f"  {'backend':8} {'weight':>6} {'expected':>9} {'measured':>9}")
    for name, w in weights.items():
        got = report["counts"].get(name, 0)
        print(f"  {name:8} {w:6.1f} {100 * w / total_w:8.1f}% {100 * got / ok:8.1f}%")


def _make_lab(mode: str, ipv6: bool = False) -> Lab:
    if mode == "nat":
        return GatewayLab(prefix="hlbdemo", backends=3, peer_xdp_pass=default_pass_obj(),
                          replace_stale=True, ipv6=ipv6)
    if mode == "tunnel":
        return TunnelLab(prefix="hlbdemo", backends=3, peer_xdp_pass=default_pass_obj(),
                         replace_stale=True)
    return Lab(prefix="hlbdemo", backends=3, peer_xdp_pass=default_pass_obj(),
               replace_stale=True, ipv6=ipv6)


def _appliance_options(mode: str, ipv6: bool) -> dict[str, Any]:
    """LabAppliance's VIPs, backend family and tunnel block for the demo."""
    if mode == "tunnel" and ipv6:
        return {"vips": (LAB_VIP, LAB_VIP6), "backend_family": 6,
                "tunnel": {"encap": "gue", "gue_port": DEFAULT_GUE_PORT,
                           "source": "fd48:4c00::f0/124"}}
    if mode == "tunnel":
        return {"vips": (LAB_VIP,), "backend_family": 4,
                "tunnel": {"encap": "ipip", "source": "198.18.0.240/28"}}
    if ipv6:
        return {"vips": (LAB_VIP, LAB_VIP6)}
    return {}


def _describe(lab: Lab, mode: str) -> str:
    backends = ", ".join(lab.ip_of(f"b{i}") for i in (1, 2, 3))
    if isinstance(lab, TunnelLab):
        six = ", ".join(lab.ip6_of(f"b{i}") for i in (1, 2, 3))
        return (f"lab up ({mode}): client {lab.ip_of('cli')} and appliance "
                f"{lab.ip_of('lb')} on the client network; router {lab.ip_of('rt')}; "
                f"backends {backends} / {six} on the backend network behind it, each "
                f"decapsulating with decap.bpf.o (XDP) and holding the VIPs on lo; "
                f"VIPs {', '.join(lab.vips)} port {LAB_PORT}")
    if isinstance(lab, GatewayLab) and lab.ipv6:
        six = ", ".join(lab.ip6_of(f"b{i}") for i in (1, 2, 3))
        return (f"lab up ({mode}, dual stack): client {lab.ip_of('cli')} / "
                f"{lab.ip6_of('cli')} on the client network, appliance {lab.ip_of('lb')} / "
                f"{lab.ip6_of('lb')} (eth0) and {lab.gateway_ip} / {lab.gateway_ip6} (eth1), "
                f"backends {backends} / {six} on the cluster network (default routes "
                f"through eth1's addresses), VIPs {LAB_VIP} and {LAB_VIP6} port {LAB_PORT}")
    if lab.ipv6:
        six = ", ".join(lab.ip6_of(f"b{i}") for i in (1, 2, 3))
        return (f"lab up ({mode}, dual stack): client {lab.ip_of('cli')} / "
                f"{lab.ip6_of('cli')}, appliance {lab.ip_of('lb')} / {lab.ip6_of('lb')}, "
                f"backends {backends} / {six}, VIPs {LAB_VIP} and {LAB_VIP6} port {LAB_PORT}")
    if isinstance(lab, GatewayLab):
        return (f"lab up ({mode}): client {lab.ip_of('cli')} on the client network, "
                f"appliance {lab.ip_of('lb')} (eth0) / {lab.gateway_ip} (eth1), backends "
                f"{backends} on the cluster network (default route {lab.gateway_ip}), "
                f"VIP {LAB_VIP}:{LAB_PORT}")
    return (f"lab up ({mode}): client {lab.ip_of('cli')}, appliance {lab.ip_of('lb')}, "
            f"backends {backends}, VIP {LAB_VIP}:{LAB_PORT}")


def nat_unavailable(dataplane: str, ipv6: bool = False) -> str | None:
    """Why this build cannot run the NAT demo (its configuration refuses ``mode:
    nat``, with ``ipv6`` an IPv6 NAT VIP), or None. Asked before a lab is built:
    nothing to tear down."""
    appliance = LabAppliance(GatewayLab(prefix="hlbdemo", ipv6=ipv6), Path("/nonexistent"),
                             WEIGHTS, dataplane=dataplane, mode="nat",
                             **_appliance_options("nat", ipv6))
    return appliance.config_problem()


def run_demo(connections: int = 600, dataplane: str = "xdp", mode: str = "dsr",
             ipv6: bool = False) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "nat" and (why := nat_unavailable(dataplane, ipv6)) is not None:
        print(f"{'IPv6 ' if ipv6 else ''}NAT mode is not available in this build yet: its "
              f"configuration is refused:\n{why}")
        return 2
    options = _appliance_options(mode, ipv6)
    with tempfile.TemporaryDirectory(prefix="hpclb-demo-") as tmp, \
            _make_lab(mode, ipv6) as lab:
        print(_describe(lab, mode))
        lab.start_backends(LAB_PORT, udp=True)
        appliance = LabAppliance(lab, Path(tmp), WEIGHTS, dataplane=dataplane, mode=mode,
                                 **options)
        try:
            with appliance:
                if (mode == "nat" and ipv6 and "nat6" not in
                        appliance.client.hello().get("capabilities", [])):
                    print(f"IPv6 NAT mode: the {dataplane} data plane has no 'nat6' "
                          f"capability")
                    return 2
                _show(lab, appliance, connections, LAB_VIP6 if ipv6 else LAB_VIP)
        except LabApplianceError as err:
            if mode != "nat":
                raise
            logs = sorted((Path(tmp) / "run").glob("*.dataplane.log"))
            tail = logs[0].read_text()[-2000:] if logs else "(no data plane log)"
            what = "IPv6 NAT mode (the hello's 'nat6')" if ipv6 else "NAT mode"
            print(f"NAT mode: the appliance did not start ({dataplane} data plane); "
                  f"this build's data plane may not implement {what} yet:\n{err}\n"
                  f"data plane log:\n{tail}")
            return 2
    print("\nlab torn down")
    return 0


def _show(lab: Lab, appliance: LabAppliance, connections: int, vip: str = LAB_VIP) -> None:
    hello = appliance.client.hello()
    print(f"appliance up: data plane {hello['dataplane']}, "
          f"attach mode {hello['attach_mode']}, ring {hello['ring_size']} slots"
          + (f", capabilities {hello['capabilities']}" if "capabilities" in hello else ""))
    report = lab.run_client(vip, LAB_PORT, connections=connections)
    _table(f"shares of new connections to {vip}", appliance.weights, report)

    appliance.set_weight("b1", 4.0)
    print("\nweight of b1 changed 1 -> 4 (config rewritten, SIGHUP)")
    report = lab.run_client(vip, LAB_PORT, connections=connections)
    _table(f"shares after the change ({vip})", appliance.weights, report)
    if isinstance(lab, TunnelLab):
        print("\nbackends' decapsulation counters: " + "; ".join(
            f"b{i} " + ", ".join(f"{k}={v}" for k, v in lab.decap_stats(i).items())
            for i in (1, 2, 3)))

    counters = appliance.client.stats()["counters"]
    print("\ndata-plane counters: " + ", ".join(
        f"{k}={v}" for k, v in counters.items() if v))
    if isinstance(lab, GatewayLab):
        with contextlib.suppress(Exception):  # an illustration, not part of the demo's verdict
            lo = lab.exec("b1", ["ip", "-4", "-o", "addr", "show", "dev", "lo"]).stdout.split()
            print(f"backend b1 holds only {lo[3] if len(lo) > 3 else '?'} on lo; its "
                  f"default route: {lab.exec('b1', ['ip', 'route', 'show', 'default']).stdout}"
                  .rstrip())
            if lab.ipv6:
                route6 = lab.exec("b1", ["ip", "-6", "route", "show", "default"]).stdout
                print(f"its IPv6 default route: {route6}".rstrip())
