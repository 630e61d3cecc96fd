"""`hpclb demo`: the appliance in the lab, shares against weights, live.

Client, appliance and three backend namespaces on a bridge; `hpclb run` with
the XDP data plane, or the DPDK forwarder (``--dataplane dpdk``: net_af_xdp on
the appliance's veth, its addresses moved to the exception TAP), in DSR mode;
N short TCP connections from the client; the share of each backend printed
next to its configured weight; a weight change by SIGHUP; the shares again.
Everything is torn down at the end, on Ctrl-C and on error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

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


def run_demo(connections: int = 600, dataplane: str = "xdp") -> int:
    with tempfile.TemporaryDirectory(prefix="hpclb-demo-") as tmp, \
            Lab(prefix="hlbdemo", backends=3, peer_xdp_pass=default_pass_obj(),
                replace_stale=True) as lab:
        print(f"lab up: client {lab.ip_of('cli')}, appliance {lab.ip_of('lb')}, "
              f"backends {', '.join(lab.ip_of(f'b{i}') for i in (1, 2, 3))}, "
              f"VIP {LAB_VIP}:{LAB_PORT}")
        lab.start_backends(LAB_PORT, udp=True)
        with LabAppliance(lab, Path(tmp), WEIGHTS, dataplane=dataplane) as appliance:
            hello = appliance.client.hello()
            print(f"appliance up: data plane {hello['dataplane']}, "
                  f"attach mode {hello['attach_mode']}, ring {hello['ring_size']} slots")
            report = lab.run_client(LAB_VIP, LAB_PORT, connections=connections)
            _table("shares of new connections", appliance.weights, report)

            appliance.set_weight("b1", 4.0)
            print("\nweight of b1 changed 1 -> 4 (config rewritten, SIGHUP)")
            report = lab.run_client(LAB_VIP, LAB_PORT, connections=connections)
            _table("shares after the change", appliance.weights, report)

            counters = appliance.client.stats()["counters"]
            print("\ndata-plane counters: " + ", ".join(
                f"{k}={v}" for k, v in counters.items() if v))
    print("\nlab torn down")
    return 0
