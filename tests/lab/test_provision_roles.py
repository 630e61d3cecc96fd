"""What the Vagrantfile runs, without VMs: the gateway, node and client roles
provisioned as `vagrant up` would, then the machines they describe started in
network namespaces named after the Vagrant machines, and traffic through the VIP.

These hosts cannot boot a VM (no nested virtualisation). So:

* The machines, their networks and their provisioning arguments are read from the
  Vagrantfile itself (tests/unit/test_vagrantfile.py's recorder of its DSL).
* One namespace per machine (``hpv-gateway``, ``hpv-node1``, ``hpv-node2``,
  ``hpv-client``) with the NICs the VM would have (management, front, cluster;
  Vagrant's own NAT is left out) and their addresses, on one bridge per Vagrant
  network (in ``hpv-sw``). The NICs are named ens6, ens7, ens8, not eth1..eth3 as on
  Debian's boxes: the gateway's provisioner must find them by their addresses and the
  configuration written must follow (interfaces and `via`).
* The CURVE keys are made by the Vagrantfile's host step (HpclbKeys.prepare) and
  each machine gets the copy its rsync exclusions leave it.
* Each machine's provisioning script is the Vagrantfile's, run by bash in that
  machine's namespace (its NIC lookups and host facts see that namespace's NICs),
  with /vagrant the checkout, the keys directory the machine's copy, and
  ``--root DIR`` (a directory tree stands for the VM's disk: no packages, no build,
  nothing live) and ``--name`` (the host name Vagrant would set) added to provision.sh.
* Then what the installed files say is done: the gateway runs ``hpclb run`` on the
  configuration provisioning wrote (its file paths re-rooted into the tree, its
  control socket and state in the test's directory); each node applies its
  rendered sysctl.d file, the VIP stanza of its ifupdown file and runs the agent and
  the test server with the command lines of their installed units and
  /etc/default files; the client runs its installed if-up.d hook (the VIP route)
  and its ``hpclb-load`` command.

The interpreter and the data plane are this checkout's build (the same sources
provision.sh copied into the trees; the build step is live only). What this
does not try: apt, the venv and `make` on a fresh VM, systemd starting the units
(no systemd here), ifupdown reading the stanza at boot, the units' sandboxes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpclb.host import install
from tests.unit.test_vagrantfile import declared

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP)")

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "hpv"
SWITCH = f"{PREFIX}-sw"
VENV = ROOT / ".venv" / "bin"
RESULTS = ROOT / "results" / "provision_roles.json"


def nic_name(k: int) -> str:
    """The namespace's name of the VM's k-th private network NIC (eth<k> on Debian's
    boxes): predictable-style names, which the provisioning must cope with."""
    return f"ens{k + 5}"


def sh(argv: list[str], timeout: float = 60, check: bool = True,
       **kw: Any) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {res.returncode}:\n"
                             f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def ns_exec(ns: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return sh(["ip", "netns", "exec", ns, *argv], **kw)


def our_namespaces() -> list[str]:
    out = sh(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}-")]


def remove_namespaces() -> None:
    """Kill every process in our namespaces, then delete them (also a crashed run's)."""
    for name in our_namespaces():
        pids = sh(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for name in our_namespaces():
        sh(["ip", "netns", "del", name], check=False)


# ------------------------------------------------------------------ the machines


class Machines:
    """The Vagrant machines as namespaces; processes started here are stopped on exit."""

    def __init__(self, decl: dict[str, Any]) -> None:
        self.decl = decl["machines"]
        self.procs: list[subprocess.Popen[str]] = []
        self.nets: dict[str, str] = {}  # the network's prefix (a.b.c) -> bridge

    def ns(self, machine: str) -> str:
        return f"{PREFIX}-{machine}"

    def build(self) -> None:
        sh(["ip", "netns", "add", SWITCH])
        ns_exec(SWITCH, ["ip", "link", "set", "lo", "up"])
        ns_exec(SWITCH, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                         "net.ipv6.conf.default.disable_ipv6=1"])
        for machine, m in self.decl.items():
            ns = self.ns(machine)
            sh(["ip", "netns", "add", ns])
            ns_exec(ns, ["ip", "link", "set", "lo", "up"])
            # No IPv6 chatter: the Vagrant networks are IPv4 only.
            ns_exec(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                         "net.ipv6.conf.default.disable_ipv6=1"])
            for k, net in enumerate(m["networks"], start=1):
                bridge = self._bridge(net["ip"])
                port, dev = f"{machine}-{k}", nic_name(k)
                ns_exec(SWITCH, ["ip", "link", "add", port, "type", "veth", "peer", "name",
                                 dev, "netns", ns])
                ns_exec(SWITCH, ["ip", "link", "set", port, "master", bridge, "up"])
                ns_exec(ns, ["ip", "addr", "add", f"{net['ip']}/24", "dev", dev])
                ns_exec(ns, ["ip", "link", "set", dev, "up"])
                # A veth hands partial checksums on; XDP-forwarded frames would keep
                # them and be dropped by the receiver (hpclb.lab.topology).
                ns_exec(ns, ["ethtool", "-K", dev, "tx", "off"], check=False)
        # XDP_TX/REDIRECT out of the gateway's data NICs reaches the bridge only when
        # the switch-side peer runs XDP (hpclb.lab.topology's docstring).
        pass_obj = install.find("pass.bpf.o")
        for k in (2, 3):
            port = f"gateway-{k}"
            ns_exec(SWITCH, ["ethtool", "-K", port, "gro", "on"], check=False)
            ns_exec(SWITCH, ["ip", "link", "set", "dev", port, "xdpdrv", "obj", str(pass_obj),
                             "sec", "xdp"])

    def _bridge(self, ip: str) -> str:
        net = ip.rsplit(".", 1)[0]
        if net not in self.nets:
            bridge = f"br{len(self.nets)}"
            ns_exec(SWITCH, ["ip", "link", "add", bridge, "type", "bridge", "stp_state", "0",
                             "forward_delay", "0", "mcast_snooping", "0"])
            ns_exec(SWITCH, ["ip", "link", "set", bridge, "up"])
            self.nets[net] = bridge
        return self.nets[net]

    def start(self, machine: str, argv: list[str], log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        with open(log, "w") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(machine), *argv],
                                    stdout=f, stderr=subprocess.STDOUT, text=True,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ------------------------------------------------------------------ the installed files


def unit_exec(root: Path, unit: str, defaults: str, specifiers: dict[str, str]) -> list[str]:
    """The ExecStart= of an installed unit, with its EnvironmentFile's variables,
    the specifiers given, and /opt/hpclb/.venv/bin/ mapped to this checkout's venv."""
    text = (root / "etc/systemd/system" / unit).read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    env: dict[str, str] = {}
    for ln in (root / defaults.lstrip("/")).read_text().splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            key, _, value = ln.partition("=")
            env[key.strip()] = value.strip().strip('"')
    cmd = line.removeprefix("ExecStart=")
    for spec, value in specifiers.items():
        cmd = cmd.replace(spec, value)
    # ${X}: one word; $X: split into words (systemd's rules).
    cmd = re.sub(r"\$\{(\w+)\}", lambda m: shlex.quote(env.get(m.group(1), "")), cmd)
    cmd = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), cmd)
    argv = shlex.split(cmd)
    return [str(VENV / Path(a).name) if a.startswith("/opt/hpclb/.venv/bin/") else a
            for a in argv]


def stanza_addresses(path: Path) -> list[str]:
    """The addresses of the ``iface lo ... static`` stanzas of an ifupdown file."""
    out, in_lo = [], False
    for ln in path.read_text().splitlines():
        words = ln.split()
        if words[:1] == ["iface"]:
            in_lo = words[1] == "lo" and words[-1] == "static"
        elif in_lo and words[:1] == ["address"]:
            out.append(words[1])
    return out


def rerooted_config(root: Path, workdir: Path) -> Path:
    """The gateway's rendered configuration with its file paths inside the tree and
    its control socket in the test's directory; everything else as provisioned."""
    config = yaml.safe_load((root / "etc/hpclb/hpclb.yaml").read_text())
    tel = config["telemetry"]
    for key in ("server_key", "allow_dir"):
        tel[key] = str(root / tel[key].lstrip("/"))
    config["appliance"]["control_socket"] = f"ipc://{workdir}/dataplane.sock"
    path = workdir / "hpclb.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------ the test


@pytest.fixture
def machines() -> Iterator[Machines]:
    if shutil.which("ruby") is None:
        pytest.skip("ruby is not installed (it comes with vagrant): the Vagrantfile "
                    "cannot be read")
    remove_namespaces()  # a crashed run's
    m = Machines(declared({"HPCLB_NODES": "2"}))
    try:
        m.build()
        yield m
    finally:
        m.stop()
        remove_namespaces()


def keys_for(machine: dict[str, Any], host_keys: Path, dest: Path) -> Path:
    """The machine's rsync copy of the keys directory: without what it excludes."""
    excluded = {Path(e).name for e in machine["synced"][0]["rsync__exclude"]
                if e.startswith(".hpclb-keys/")}
    dest.mkdir(parents=True)
    for f in host_keys.iterdir():
        if f.name not in excluded:
            shutil.copy2(f, dest / f.name)
    return dest


def provision(machines: Machines, name: str, workdir: Path, host_keys: Path) -> dict[str, Any]:
    """The machine's provisioning script from the Vagrantfile, run by bash in its
    namespace, /vagrant being this checkout (the keys directory the machine's copy),
    --root and --name added; twice. Returns the first run's report and duration."""
    m = machines.decl[name]
    (prov,) = m["provisions"]
    root = workdir / name / "root"
    root.mkdir(parents=True)
    keys = keys_for(m, host_keys, workdir / name / "synced-keys")
    added = f"--root {root} --name {m['hostname']}"
    script = (prov["inline"]
              .replace("/vagrant/appliance/provision.sh",
                       f"/vagrant/appliance/provision.sh {added}")
              .replace("/vagrant/.hpclb-keys", str(keys))
              .replace("/vagrant/", f"{ROOT}/"))
    assert " /vagrant" not in script, script  # every path of the share replaced
    t0 = time.monotonic()
    res = ns_exec(machines.ns(name), ["bash", "-c", script], timeout=300)
    took = time.monotonic() - t0
    # Again: nothing of the role's plan changes. (The tree may: a file of the
    # checkout edited meanwhile is copied again; tests/provision/ holds the
    # tree's idempotency on a frozen source.)
    again = ns_exec(machines.ns(name), ["bash", "-c", script], timeout=300)
    changed = [ln for ln in again.stdout.splitlines()
               if ln.startswith("changed:") and not ln.startswith("changed: tree:")]
    assert changed == [], again.stdout
    return {"root": root, "report": res.stdout, "seconds": took}


def first_connection(machines: Machines, vip: str, port: int, deadline_s: float) -> float:
    """Seconds until one TCP connection through the VIP gets a node's name."""
    probe = ("import socket,sys\n"
             "s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=0.5)\n"
             "print(s.recv(64).decode().strip())\n")
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        res = ns_exec(machines.ns("client"), [sys.executable, "-c", probe, vip, str(port)],
                      check=False, timeout=10)
        if res.returncode == 0 and res.stdout.strip().startswith("node"):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"no connection through {vip}:{port} within {deadline_s}s")


def test_vagrant_roles_in_namespaces(machines: Machines, tmp_path: Path) -> None:
    figures: dict[str, Any] = {}
    # The Vagrantfile's host step: the keys, before any machine boots.
    repo = tmp_path / "repo"
    (repo / "appliance" / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "appliance/examples/vagrant.yaml", repo / "appliance/examples")
    sh(["ruby", "-e", "module Vagrant; def self.configure(*) = nil; end; load ARGV[0]; "
        "HpclbKeys.prepare(ARGV[1])", str(ROOT / "Vagrantfile"), str(repo)])
    host_keys = repo / ".hpclb-keys"

    done = {name: provision(machines, name, tmp_path, host_keys)
            for name in ("gateway", "node1", "node2", "client")}
    figures["provision_s"] = {n: round(d["seconds"], 2) for n, d in done.items()}
    gw_root, client_root = done["gateway"]["root"], done["client"]["root"]
    config = yaml.safe_load((gw_root / "etc/hpclb/hpclb.yaml").read_text())
    vip = config["vips"][0]
    # Found by address: the front and cluster NICs, whatever their names.
    assert config["appliance"]["interfaces"] == {"ingress": nic_name(2),
                                                 "egress": [nic_name(3)]}
    assert {b["via"] for b in config["pools"]["nodes"]["backends"]} == {nic_name(3)}
    assert sorted(p.name for p in (gw_root / "etc/hpclb/curve/agents").iterdir()) == [
        "node1.key", "node2.key"]

    # The nodes: sysctls, the VIP on lo, the test server and the agent, as installed.
    for node in ("node1", "node2"):
        root, ns = done[node]["root"], machines.ns(node)
        for conf in sorted((root / "etc/sysctl.d").glob("*.conf")):
            ns_exec(ns, ["sysctl", "-q", "-p", str(conf)])
        vips = stanza_addresses(root / "etc/network/interfaces.d/60-hpclb-vips")
        assert vips == [f"{vip['address']}/32"]
        for address in vips:
            ns_exec(ns, ["ip", "addr", "replace", address, "dev", "lo"])
        arp_ignore = ns_exec(ns, ["sysctl", "-n", "net.ipv4.conf.all.arp_ignore"])
        assert arp_ignore.stdout.strip() == "1"
        server = unit_exec(root, "hpclb-testserver.service", "/etc/default/hpclb-testserver",
                           {"%l": node})
        machines.start(node, server, tmp_path / f"{node}-testserver.log",
                       {"PYTHONPATH": str(root / "opt/hpclb/control")})
        creds = tmp_path / node / "credentials"  # what LoadCredential= hands the agent
        creds.mkdir()
        shutil.copy(root / f"etc/hpclb/curve/{node}.key_secret", creds / "agent.key_secret")
        shutil.copy(root / "etc/hpclb/curve/server.key", creds / "server.key")
        agent = unit_exec(root, "hpclb-agent.service", "/etc/default/hpclb-agent",
                          {"%l": node, "%d": str(creds)})
        assert "--connect" in agent and agent[agent.index("--connect") + 1] == (
            "tcp://192.168.56.10:5557")
        agent += ["--base-interval", "0.5"]  # a quicker heartbeat than the default 5 s
        machines.start(node, agent, tmp_path / f"{node}-agent.log",
                       {"PYTHONPATH": str(root / "opt/hpclb/control")})

    # The client: its installed if-up.d hook makes the VIP route.
    hook = client_root / "etc/network/if-up.d/hpclb-vip-routes"
    ns_exec(machines.ns("client"), ["sh", str(hook)])
    route = ns_exec(machines.ns("client"), ["ip", "route", "show", f"{vip['address']}/32"])
    assert "via 10.98.1.10" in route.stdout

    # The gateway: its sysctls (net.* only: vm.* is the host's, not the namespace's) and
    # `hpclb run` on the configuration provisioning wrote.
    for conf in sorted((gw_root / "etc/sysctl.d").glob("*.conf")):
        for ln in conf.read_text().splitlines():
            if ln.strip().startswith("net."):
                key, _, value = ln.partition("=")
                ns_exec(machines.ns("gateway"), ["sysctl", "-qw",
                                                 f"{key.strip()}={value.strip()}"])
    work = tmp_path / "gateway-run"
    work.mkdir()
    cfg = rerooted_config(gw_root, work)
    machines.start("gateway", [str(VENV / "hpclb"), "run", "-c", str(cfg), "--state-dir",
                               str(work / "state"), "--run-dir", str(work / "run")],
                   tmp_path / "gateway-run.log")
    first = first_connection(machines, vip["address"], vip["port"], deadline_s=60)
    figures["run_to_first_connection_s"] = round(first, 2)
    # provision.sh (the gateway's first run) + `hpclb run` until the first connection
    # through the VIP is answered: the time to the first packet forwarded, with the
    # nodes already serving (they are provisioned after the gateway in `vagrant up`,
    # but their boot is not the gateway's).
    figures["gateway_provision_to_first_connection_s"] = round(
        done["gateway"]["seconds"] + first, 2)

    # `hpclb status -c` (what `vagrant ssh gateway -c 'sudo hpclb status -c ...'` shows):
    # both nodes up, their telemetry heard.
    deadline = time.monotonic() + 30
    while True:
        st = sh([str(VENV / "hpclb"), "status", "-c", str(cfg), "--run-dir",
                 str(work / "run"), "--json"], check=False)
        status = json.loads(st.stdout) if st.returncode == 0 and st.stdout.strip() else {}
        health = status.get("health", {})
        nodes = {"node1", "node2"}
        # Up by the probes, and each agent's telemetry an input of its weight.
        if all(health.get(n, {}).get("up") for n in nodes) and \
                set(status.get("inputs", {})) >= nodes:
            break
        assert time.monotonic() < deadline, (
            {k: status.get(k) for k in ("health", "inputs", "telemetry")}, st.stderr[-2000:],
            (tmp_path / "gateway-run.log").read_text()[-3000:])
        time.sleep(0.5)
    text = sh([str(VENV / "hpclb"), "status", "-c", str(cfg), "--run-dir",
               str(work / "run")]).stdout
    assert "node1" in text and "node2" in text

    # Load from the client with its installed hpclb-load command: every connection
    # answered, by both nodes, straight from them (DSR: their front NIC sends the
    # answers; the gateway forwards nothing in its kernel).
    # The script as installed, its interpreter this checkout's venv.
    load = tmp_path / "hpclb-load"
    load.write_text((client_root / "usr/local/bin/hpclb-load").read_text().replace(
        "/opt/hpclb/.venv/bin/python", str(VENV / "python")))

    def front_tx(node: str) -> int:
        counter = f"/sys/class/net/{nic_name(2)}/statistics/tx_packets"
        out = ns_exec(machines.ns(node), ["cat", counter])
        return int(out.stdout)

    tx_before = {n: front_tx(n) for n in ("node1", "node2")}
    client_env = {**os.environ, "PYTHONPATH": str(client_root / "opt/hpclb/control")}
    res = ns_exec(machines.ns("client"), ["sh", str(load), "--connections", "200", "--json"],
                  timeout=120, env=client_env)
    result = json.loads(res.stdout)
    figures["load"] = {k: result[k] for k in ("connections", "ok", "failures", "counts")}
    assert result["ok"] == 200 and result["failures"] == 0, result
    assert set(result["counts"]) == {"node1", "node2"}, result
    for n in ("node1", "node2"):
        assert front_tx(n) - tx_before[n] >= result["counts"][n], "answers leave by the front NIC"
    # UDP on the same VIP port (the test server's --udp answers from the VIP).
    res = ns_exec(machines.ns("client"), ["sh", str(load), "--udp", "--connections", "50",
                                          "--json"], timeout=120, env=client_env)
    udp = json.loads(res.stdout)
    figures["load_udp"] = {k: udp[k] for k in ("connections", "ok", "failures", "counts")}
    assert udp["ok"] == 50 and set(udp["counts"]) == {"node1", "node2"}, udp
    forwarding = ns_exec(machines.ns("gateway"), ["sysctl", "-n", "net.ipv4.ip_forward"])
    assert forwarding.stdout.strip() == "0"

    figures["conditions"] = (
        "provision.sh --root per machine inside its namespace (no packages, no venv/make: "
        "live only); XDP native on veth; this checkout's build; 2 shared vCPUs; "
        "probes tcp/80 every 2 s, rise 2; agents every 0.5 s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
