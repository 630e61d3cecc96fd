"""The VRRP pair's files (hpclb.announce.vrrp.render, from the `vrrp:` section
of the configuration): keepalived.conf carries the pair's settings and passes
keepalived's own configuration test (`keepalived -t`, keepalived 2.2), a broken
one fails it; the track script says healthy only while the status file is fresh,
the data plane's process lives and (XDP) a program is attached to the ingress."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpclb.announce.vrrp import Rendered, config_test, render, write_member_files
from hpclb.config.loader import ConfigError, parse_config
from hpclb.config.schema import HpclbConfig

NEXT_HOP = "198.18.0.1"
ADDRESSES = {"pair-a": "198.18.0.3", "pair-b": "198.18.0.4"}


def config(name: str, vrrp: dict[str, Any], dataplane: str = "xdp",
           ingress: str = "eth0") -> HpclbConfig:
    return parse_config(yaml.safe_dump({
        "appliance": {"name": name, "dataplane": dataplane,
                      "interfaces": {"ingress": ingress},
                      "hash_key": "000102030405060708090a0b0c0d0e0f"},
        "pools": {"p": {"backends": [{"name": "b1", "address": "198.18.0.11"},
                                     {"name": "b2", "address": "198.18.0.12"}]}},
        "vips": [{"name": "web", "address": "198.18.1.10", "port": 80, "pool": "p"},
                 {"name": "web2", "address": "198.18.1.11", "port": 80, "pool": "p"}],
        "vrrp": vrrp,
    }), "test")


def member_vrrp(settings: dict[str, Any], role: str) -> dict[str, Any]:
    """One member's `vrrp:` section: the pair's settings, its role and, with
    unicast adverts, its own address first."""
    out = {**settings, "role": role}
    if out.pop("unicast", False):
        me, other = (ADDRESSES["pair-a"], ADDRESSES["pair-b"])[:: 1 if role == "active" else -1]
        out |= {"unicast_src": me, "unicast_peer": other}
    return out


def pair(tmp_path: Path, settings: dict[str, Any], dataplane: str = "xdp",
         ingress: str = "eth0") -> dict[str, Rendered]:
    return {role: render(config(name, member_vrrp(settings, role), dataplane, ingress),
                         run_dir=tmp_path / "run", check_script=tmp_path / f"{name}.sh")
            for role, name in (("active", "pair-a"), ("standby", "pair-b"))}


def test_rendered_carries_the_pair_settings(tmp_path: Path) -> None:
    settings = {"next_hop": NEXT_HOP, "vrid": 42, "advert_int": 0.25, "priority_active": 200,
                "priority_standby": 90, "unicast": True, "vips_on_interface": True,
                "extra_addresses": [{"address": "10.20.0.1/16", "interface": "eth1"}]}
    files = pair(tmp_path, settings)
    a, b = files["active"].keepalived_conf, files["standby"].keepalived_conf
    for text in (a, b):
        assert "state BACKUP" in text and "nopreempt" in text
        assert "virtual_router_id 42" in text and "advert_int 0.25" in text
        assert "vrrp_version 3" in text
        assert f"{NEXT_HOP}/24 dev eth0" in text
        assert "198.18.1.10/32 dev eth0" in text and "198.18.1.11/32 dev eth0" in text
        assert "10.20.0.1/16 dev eth1" in text
    assert "priority 200" in a and "priority 90" in b
    assert "unicast_src_ip 198.18.0.3" in a and "unicast_src_ip 198.18.0.4" in b
    assert f'script "{tmp_path}/pair-a.sh"' in a
    assert f"{tmp_path}/run/pair-b.status.json" in files["standby"].check_script
    # The members' files differ only where the pair says they do.
    diff = [(x, y) for x, y in zip(a.splitlines(), b.splitlines(), strict=True) if x != y]
    assert all(any(k in x for k in ("priority", "unicast", "198.18.0.", "pair-a", "hpclb_pair"))
               for x, _ in diff), diff


def test_defaults_multicast_next_hop_only(tmp_path: Path) -> None:
    text = pair(tmp_path, {"next_hop": NEXT_HOP})["active"].keepalived_conf
    instance = text.split("vrrp_instance")[1]
    assert "unicast_src_ip" not in instance and "unicast_peer" not in instance
    assert "198.18.1.10" not in text  # the VIPs stay put: only the next hop moves
    assert "advert_int 1\n" in text and "priority 150" in text


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"vrid": 0}, "vrid"), ({"vrid": 256}, "vrid"),
    ({"priority_active": 100, "priority_standby": 100}, "priority_active must be above"),
    ({"priority_active": 100, "priority_standby": 150}, "priority_active must be above"),
    ({"advert_int": 0.0}, "advert_int"), ({"advert_int": 0.125}, "centiseconds"),
    ({"unicast_peer": "198.18.0.4"}, "both unicast_src"),
    ({"unicast_peer": "198.18.0.4", "unicast_src": "198.18.0.4"}, "own address"),
    ({"instance": "1bad"}, "instance"), ({"fall": 0}, "fall"), ({"role": "master"}, "role"),
    ({"next_hop": "198.18.1.10"}, "is a VIP"), ({"bogus": 1}, "bogus"),
    ({"extra_addresses": [{"address": "10.0.0.300/24", "interface": "eth1"}]}, "address"),
    ({"extra_addresses": [{"address": "10.0.0.1/24", "interface": "eth1 x"}]}, "interface"),
])
def test_settings_refused(kwargs: dict[str, object], says: str) -> None:
    # A clear error naming the field, as for every section of the configuration.
    with pytest.raises(ConfigError, match=says):
        config("pair-a", {"next_hop": NEXT_HOP, "role": "active", **kwargs})


def test_no_section_no_files(tmp_path: Path) -> None:
    plain = config("pair-a", {"next_hop": NEXT_HOP, "role": "active"}).model_copy(
        update={"vrrp": None})
    with pytest.raises(ValueError, match="no vrrp: section"):
        render(plain, check_script=tmp_path / "x.sh")


def in_netns_with(ifname: str) -> list[str]:
    """A command prefix: a fresh network namespace holding a veth ``ifname``
    (keepalived -t checks the instance's interface exists)."""
    return ["unshare", "--net", "sh", "-c",
            f"ip link add {ifname} type veth peer name {ifname}p && "
            f'ip link set {ifname} up && exec "$@"', "sh"]


@pytest.mark.skipif(shutil.which("keepalived") is None,
                    reason="keepalived is not installed (Debian package keepalived)")
@pytest.mark.skipif(os.geteuid() != 0,
                    reason="keepalived -t runs in a namespace of its own: needs root")
@pytest.mark.parametrize("unicast", [False, True])
def test_keepalived_accepts_what_is_rendered(tmp_path: Path, unicast: bool) -> None:
    settings = {"next_hop": NEXT_HOP, "advert_int": 0.5, "unicast": unicast,
                "vips_on_interface": unicast,
                "extra_addresses": [{"address": "10.20.0.1/16", "interface": "hlbt0p"}]
                if unicast else []}
    for (role, rendered), name in zip(pair(tmp_path, settings, ingress="hlbt0").items(),
                                      ("pair-a", "pair-b"), strict=True):
        conf, script = tmp_path / f"{role}.conf", tmp_path / f"{name}.sh"
        write_member_files(rendered, conf, script)
        res = subprocess.run([*in_netns_with("hlbt0"), "keepalived", "-t", "-l", "-f",
                              str(conf), "-p", str(tmp_path / "k.pid"), "-r",
                              str(tmp_path / "v.pid"), "-c", str(tmp_path / "c.pid")],
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0, (role, res.stdout, res.stderr, conf.read_text())
        # The same test fails a broken file: an unknown keyword...
        broken = tmp_path / f"{role}-broken.conf"
        broken.write_text(conf.read_text().replace("advert_int", "advert_intx"))
        res = subprocess.run([*in_netns_with("hlbt0"), "keepalived", "-t", "-l", "-f",
                              str(broken), "-p", str(tmp_path / "k.pid"), "-r",
                              str(tmp_path / "v.pid"), "-c", str(tmp_path / "c.pid")],
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode != 0, res.stderr
    # ... and an interface this host lacks (config_test runs where we are).
    res = config_test(tmp_path / "active.conf")
    if not Path("/sys/class/net/hlbt0").exists():
        assert res.returncode != 0, res.stderr


def run_check(script: Path, netns_if: str | None = None) -> int:
    argv = [*(in_netns_with(netns_if) if netns_if else []), "sh", str(script)]
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode


def test_check_script_verdicts(tmp_path: Path) -> None:
    """Exit 0 healthy; 1 no status file; 2 stale status; 3 no data plane (no
    pid file, or a dead pid); 4 (XDP) no program on the ingress."""
    run = tmp_path / "run"
    run.mkdir()
    settings = {"next_hop": NEXT_HOP, "status_max_age_s": 3}
    auto = pair(tmp_path, settings, dataplane="auto")["active"]  # no XDP check
    script = tmp_path / "check-auto.sh"
    write_member_files(auto, tmp_path / "a.conf", script)
    status, pidfile = run / "pair-a.status.json", run / "pair-a.pid"

    assert run_check(script) == 1
    status.write_text("{}")
    assert run_check(script) == 3
    pidfile.write_text(f"{os.getpid()}\n")
    assert run_check(script) == 0
    old = time.time() - 10
    os.utime(status, (old, old))
    assert run_check(script) == 2
    status.write_text("{}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    pidfile.write_text(f"{dead.pid}\n")
    assert run_check(script) == 3
    pidfile.write_text(f"{os.getpid()}\n")
    assert run_check(script) == 0

    xdp = pair(tmp_path, settings, dataplane="xdp", ingress="hlbt0")["active"]
    assert "prog/xdp" in xdp.check_script and "prog/xdp" not in auto.check_script
    if os.geteuid() == 0 and shutil.which("unshare"):
        xscript = tmp_path / "check-xdp.sh"
        write_member_files(xdp, tmp_path / "x.conf", xscript)
        assert run_check(xscript, "hlbt0") == 4  # a veth, no program
