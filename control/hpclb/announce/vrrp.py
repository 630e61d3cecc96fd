"""An active/standby pair: keepalived's configuration and track script,
rendered from a configuration with a `vrrp:` section (hpclb.config.vrrp).

What keepalived moves. Clients reach a VIP by routing it via an appliance
address, so a pair moves a *VRRP virtual address on the client-facing segment*,
the VIPs' next hop: the client (or its router) routes the VIPs via it; the
member holding it is the one the neighbour entry points at, and a takeover
sends gratuitous ARPs that move that entry. Optionally (``vips_on_interface``)
the VIPs themselves are virtual addresses too, for L2-adjacent clients.

Each member's keepalived tracks a script (``templates/hpclb-vrrp-check.sh.j2``):
the status file of `hpclb run` fresh, the data plane's process alive, and (XDP)
a program attached to the ingress; a failure puts the instance in FAULT (no
weight: with ``nopreempt`` a priority drop alone would not hand over). Both
members start BACKUP with ``nopreempt``: the higher priority wins the first
election only, and a member that comes back stays BACKUP, never flapping back.

Provisioning installs the two files (``KEEPALIVED_CONF``, ``CHECK_SCRIPT``)
and the ``hpclb-keepalived`` unit; the lab (``hpclb.lab.vrrp``) renders the
same files for its two members.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from hpclb.config.schema import Dataplane, HpclbConfig

KEEPALIVED_TEMPLATE = "keepalived.conf.j2"
CHECK_TEMPLATE = "hpclb-vrrp-check.sh.j2"
#: Where `hpclb run` writes NAME.status.json and the data plane's NAME.pid.
RUN_DIR = Path("/run/hpclb")


@dataclass(frozen=True)
class Rendered:
    """One member's files: keepalived.conf and its track script."""

    keepalived_conf: str
    check_script: str


def _env() -> Environment:
    return Environment(loader=PackageLoader("hpclb", "templates"), undefined=StrictUndefined,
                       keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render(config: HpclbConfig, *, run_dir: Path = RUN_DIR,
           check_script: Path) -> Rendered:
    """keepalived.conf and the track script of the member whose configuration
    is ``config`` (it must have a `vrrp:` section), run with ``run_dir``;
    ``check_script`` is where the script will be installed (root-owned, not
    writable by others: keepalived's script security)."""
    vrrp = config.vrrp
    if vrrp is None:
        raise ValueError("the configuration has no vrrp: section")
    app = config.appliance
    vip_addresses: list[str] = []
    if vrrp.vips_on_interface:
        vip_addresses = sorted({f"{v.address}/{v.address.max_prefixlen}" for v in config.vips})
    # AUTO picks XDP or DPDK at start: only XDP has a program to look for.
    check_xdp = app.dataplane == Dataplane.XDP
    values: dict[str, Any] = {
        "name": app.name, "role": vrrp.role, "instance": vrrp.instance,
        "interface": app.interfaces.ingress, "vrid": vrrp.vrid, "priority": vrrp.priority,
        "advert_int": f"{vrrp.advert_int:g}", "next_hop": str(vrrp.next_hop),
        "prefixlen": vrrp.prefixlen, "vip_addresses": vip_addresses,
        "extra_addresses": [{"cidr": str(ipaddress.ip_interface(e.address)),
                             "dev": e.interface} for e in vrrp.extra_addresses],
        "unicast_src": "" if vrrp.unicast_src is None else str(vrrp.unicast_src),
        "unicast_peer": "" if vrrp.unicast_peer is None else str(vrrp.unicast_peer),
        "script_name": f"hpclb_{re.sub(r'[^A-Za-z0-9_]', '_', app.name)}",
        "check_script": str(check_script),
        "check_interval_s": vrrp.check_interval_s, "check_timeout_s": vrrp.check_timeout_s,
        "fall": vrrp.fall, "rise": vrrp.rise, "status_max_age_s": vrrp.status_max_age_s,
        "check_xdp": check_xdp, "garp_repeat": vrrp.garp_repeat,
        "garp_delay_s": vrrp.garp_delay_s, "garp_refresh_s": vrrp.garp_refresh_s,
        "status_file": str(run_dir / f"{app.name}.status.json"),
        "pid_file": str(run_dir / f"{app.name}.pid"),
    }
    env = _env()
    return Rendered(env.get_template(KEEPALIVED_TEMPLATE).render(**values),
                    env.get_template(CHECK_TEMPLATE).render(**values))


def write_member_files(rendered: Rendered, conf: Path, check_script: Path) -> None:
    """Write keepalived.conf (0644) and the track script (0700), root's as this
    process is."""
    check_script.write_text(rendered.check_script)
    check_script.chmod(0o700)
    conf.write_text(rendered.keepalived_conf)
    conf.chmod(0o644)


def config_test(conf: Path, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``keepalived -t -f conf`` (keepalived 2.2's configuration test; exit 0 when
    valid). Its pid files go to a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="hpclb-kad-t-") as tmp:
        return subprocess.run(
            ["keepalived", "-t", "-l", "-f", str(conf), "-p", f"{tmp}/k.pid",
             "-r", f"{tmp}/v.pid", "-c", f"{tmp}/c.pid"],
            capture_output=True, text=True, timeout=timeout_s, check=False)
