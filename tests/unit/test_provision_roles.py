"""The node and client roles' plans (hpclb.provision.node, .client) on directory
trees: what they write, that a second run changes nothing, that --check changes
nothing, the key exchange, and the choices they make from the configuration.
The same plans run end to end, as the Vagrantfile runs them, in
tests/lab/test_provision_roles.py."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
import zmq.auth

from hpclb.provision import client, node
from hpclb.provision.plan import Context, ProvisionError, run_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "appliance" / "examples" / "vagrant.yaml"
RAW: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())


def ctx(root: Path, check: bool = False) -> Context:
    return Context(root=root, live=False, check=check, src=ROOT, out=lambda _line: None)


def variant(tmp_path: Path, change: Any) -> Path:
    """The example with ``change(config)`` applied, in a file."""
    data = copy.deepcopy(RAW)
    change(data)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def keygen(directory: Path, name: str) -> None:
    subprocess.run([sys.executable, "-m", "hpclb.agent.main", "keygen", str(directory),
                    "--name", name], check=True, capture_output=True, timeout=60)


def run_node(root: Path, opts: node.NodeOptions, check: bool = False) -> Context:
    c = ctx(root, check)
    run_plan(node.plan(c, opts), c)
    return c


def test_node_tree_then_no_change(tmp_path: Path) -> None:
    root, keys = tmp_path / "root", tmp_path / "keys"
    root.mkdir()
    keys.mkdir()
    keygen(keys, "server")
    (keys / "server.key_secret").unlink()  # what a node's copy holds: the public half
    opts = node.NodeOptions("node1", EXAMPLE, gateway=None, keys_dir=keys)

    checked = run_node(root, opts, check=True)
    assert checked.lines[-1].endswith("would be made (--check)")
    assert list(root.iterdir()) == [], "--check changed nothing"

    first = run_node(root, opts)
    assert first.lines[-1].startswith("provision: ") and "no change" not in first.lines[-1]
    etc = root / "etc"
    assert "HPCLB_CONNECT=tcp://192.168.56.10:5557\n" in (
        etc / "default/hpclb-agent").read_text()
    server_defaults = (etc / "default/hpclb-testserver").read_text()
    assert "HPCLB_TESTSERVER_PORT=80\n" in server_defaults
    assert "HPCLB_TESTSERVER_ARGS=--udp\n" in server_defaults  # the VIP serves UDP/80 too
    stanza = (etc / "network/interfaces.d/60-hpclb-vips").read_text()
    assert "auto lo\n" in stanza and "iface lo inet static\n    address 10.98.9.10/32\n" in stanza
    sysctl = (etc / "sysctl.d/60-hpclb-node.conf").read_text()
    for line in ("net.ipv4.conf.all.arp_ignore = 1", "net.ipv4.conf.all.arp_announce = 2"):
        assert line in sysctl
    units = etc / "systemd/system"
    assert sorted(p.name for p in units.glob("*.service")) == [
        "hpclb-agent.service", "hpclb-testserver.service"], "a node gets the node's units only"
    assert (units / "multi-user.target.wants/hpclb-testserver.service").is_symlink()
    assert "skipped (--root): start hpclb-agent.service" in first.lines
    assert "skipped (--root): VIP 10.98.9.10/32 on lo" in first.lines

    # The agent's pair was made here (none in the keys dir), its public half exported
    # for the gateway; the secret is root's alone (the unit passes it as a credential).
    secret = etc / "hpclb/curve/node1.key_secret"
    public, sec = zmq.auth.load_certificate(secret)
    assert sec is not None and zmq.curve_public(sec) == public
    assert secret.stat().st_mode & 0o777 == 0o600
    assert (keys / "node1.key").read_bytes() == (etc / "hpclb/curve/node1.key").read_bytes()
    assert (etc / "hpclb/curve/server.key").read_bytes() == (keys / "server.key").read_bytes()

    again = run_node(root, opts)
    assert again.lines[-1] == "provision: no change"
    assert not any(line.startswith("changed:") for line in again.lines)


def test_node_installs_a_pair_made_beforehand(tmp_path: Path) -> None:
    """Vagrant makes the pairs on the host: the node installs its own, unchanged."""
    root, keys = tmp_path / "root", tmp_path / "keys"
    root.mkdir()
    for name in ("server", "node2"):
        keygen(keys, name)
    opts = node.NodeOptions("node2", EXAMPLE, keys_dir=keys)
    lines = run_node(root, opts).lines
    assert any("install keypair from" in line for line in lines), lines
    curve = root / "etc/hpclb/curve"
    assert (curve / "node2.key_secret").read_bytes() == (keys / "node2.key_secret").read_bytes()
    assert not (curve / "server.key_secret").exists()


def test_node_without_keys_dir_or_server_key_says_what_to_do(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lines = run_node(root, node.NodeOptions("node1", EXAMPLE)).lines
    assert any("no --keys-dir" in line for line in lines)
    keys = tmp_path / "empty"
    keys.mkdir()
    lines = run_node(tmp_path / "root", node.NodeOptions("node1", EXAMPLE, keys_dir=keys)).lines
    assert any("server.key is not there yet" in line for line in lines)


def test_node_adds_the_source_line_only_when_missing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc/network").mkdir(parents=True)
    interfaces = root / "etc/network/interfaces"
    interfaces.write_text("auto lo\niface lo inet loopback\n")
    run_node(root, node.NodeOptions("node1", EXAMPLE))
    assert interfaces.read_text() == (
        "auto lo\niface lo inet loopback\nsource /etc/network/interfaces.d/*\n")
    debian = "source /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n"
    interfaces.write_text(debian)
    assert run_node(root, node.NodeOptions("node1", EXAMPLE)).lines[-1] == (
        "provision: no change")
    assert interfaces.read_text() == debian


def test_node_choices_from_the_configuration(tmp_path: Path) -> None:
    config = node.read_config(EXAMPLE)
    assert node.connect_endpoint(config, None) == "tcp://192.168.56.10:5557"
    assert node.connect_endpoint(config, "fd00::1") == "tcp://[fd00::1]:5557"
    assert node.dsr_vips(config) == ["10.98.9.10"]

    def two_ports(c: dict[str, Any]) -> None:
        c["vips"].append({"name": "alt", "address": "10.98.9.11", "port": 8080,
                          "protocol": "tcp", "mode": "dsr", "pool": "nodes"})

    config = node.read_config(variant(tmp_path, two_ports))
    text, notes = node.testserver_defaults(config)
    assert "HPCLB_TESTSERVER_PORT=80\n" in text
    assert notes == ["note: the test server answers port 80 only, not [8080]"]
    assert node.dsr_vips(config) == ["10.98.9.10", "10.98.9.11"]
    stanza = node.vip_stanza([*node.dsr_vips(config), "fd00:98::10"])
    assert "iface lo inet static\n    address 10.98.9.11/32" in stanza
    assert "iface lo inet6 static\n    address fd00:98::10/128" in stanza

    def no_telemetry(c: dict[str, Any]) -> None:
        del c["telemetry"]
        c["pools"]["nodes"]["weights"] = "static"

    with pytest.raises(ProvisionError, match="no telemetry section"):
        node.plan(ctx(tmp_path), node.NodeOptions("node1", variant(tmp_path, no_telemetry)))
    with pytest.raises(ProvisionError, match="--config"):
        node.plan(ctx(tmp_path), node.NodeOptions("node1", tmp_path / "absent.yaml"))


def test_node_of_a_nat_pool_serves_the_backend_port(tmp_path: Path) -> None:
    """A NAT VIP: no VIP on lo, the test server on the backend port."""
    def nat(c: dict[str, Any]) -> None:
        for v in c["vips"]:
            v["mode"] = "nat"
            v["backend_port"] = 8080

    root = tmp_path / "root"
    root.mkdir()
    lines = run_node(root, node.NodeOptions("node1", variant(tmp_path, nat))).lines
    assert "HPCLB_TESTSERVER_PORT=8080\n" in (root / "etc/default/hpclb-testserver").read_text()
    assert not (root / "etc/network/interfaces.d/60-hpclb-vips").exists()
    assert any("no DSR or tunnel VIP" in line for line in lines)
    assert "arp_ignore" not in (root / "etc/sysctl.d/60-hpclb-node.conf").read_text()


def test_node_not_in_the_pool_is_told(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lines = run_node(root, node.NodeOptions("node9", EXAMPLE)).lines
    assert any("node9 is no backend" in line for line in lines)


def test_client_routes_and_load_command(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    opts = client.ClientOptions(EXAMPLE, gateway="10.98.1.10")
    c = ctx(root)
    run_plan(client.plan(c, opts), c)
    hook = root / "etc/network/if-up.d/hpclb-vip-routes"
    assert hook.stat().st_mode & 0o777 == 0o755
    assert "ip route replace 10.98.9.10/32 via 10.98.1.10 2>/dev/null || true\n" in (
        hook.read_text())
    assert "skipped (--root): route 10.98.9.10/32 via 10.98.1.10" in c.lines
    load = (root / "usr/local/bin/hpclb-load").read_text()
    assert ("exec /opt/hpclb/.venv/bin/python -m hpclb.lab.node client --vip 10.98.9.10 "
            "--port 80 \"$@\"\n") in load
    if shutil.which("sh"):
        subprocess.run(["sh", "-n", str(hook)], check=True)  # the hook parses
    again = ctx(root)
    run_plan(client.plan(again, opts), again)
    assert again.lines[-1] == "provision: no change"

    bare = ctx(tmp_path / "bare")
    (tmp_path / "bare").mkdir()
    run_plan(client.plan(bare, client.ClientOptions(EXAMPLE)), bare)
    assert any("no --gateway" in line for line in bare.lines)
    assert not (tmp_path / "bare/etc/network/if-up.d/hpclb-vip-routes").exists()
