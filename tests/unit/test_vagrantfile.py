"""The top-level Vagrantfile: `vagrant validate`, and the machines, networks and
provisioning arguments it declares against appliance/examples/vagrant.yaml.

No VM boots here (no nested virtualisation): `vagrant validate --ignore-provider`
checks the Vagrantfile the way CI can without VirtualBox or libvirt installed (a plain
`vagrant validate` refuses to run without a usable provider), and a stub of Vagrant's
configuration DSL, run by the same Ruby, records what the Vagrantfile declares so that
it can be compared with the example configuration the gateway is provisioned from.
What the provisioning itself does is tests/lab/test_provision_roles.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
import zmq.auth

from hpclb.config import load_config

ROOT = Path(__file__).resolve().parents[2]
VAGRANTFILE = ROOT / "Vagrantfile"
EXAMPLE = ROOT / "appliance" / "examples" / "vagrant.yaml"

# A stand-in for Vagrant's configuration objects: records machines (host name,
# networks, provisioners, synced folders) and ignores everything else (provider
# blocks, triggers). Prints one JSON object.
RECORDER = r"""
require "json"
class Anything
  def method_missing(*_args, **_kw) = self
  def respond_to_missing?(*) = true
end
class ProviderRec
  def initialize(data) = @data = data
  def customize(args) = (@data["customize"] ||= []) << args.map(&:to_s)
  def method_missing(name, *args, **_kw)
    raise NoMethodError, "provider setting #{name} read" unless name.to_s.end_with?("=")
    @data[name.to_s.chomp("=")] = args.first
  end
  def respond_to_missing?(*) = true
end
class VmRec
  attr_reader :data
  def initialize(data) = @data = data
  def hostname=(v)
    @data["hostname"] = v
  end
  def box=(v)
    @data["box"] = v
  end
  def add(list, entry) = (@data[list] ||= []) << entry
  def network(kind, **o) = add("networks", { "kind" => kind.to_s, **o.transform_keys(&:to_s) })
  def provision(name, **o) = add("provisions", { "name" => name, **o.transform_keys(&:to_s) })
  def synced_folder(src, dst, **o)
    add("synced", { "src" => src, "dst" => dst, **o.transform_keys(&:to_s) })
  end
  def provider(name)
    yield ProviderRec.new(((@data["providers"] ||= {})[name.to_s] ||= {}))
  end
  def define(name, &blk)
    m = MachineRec.new
    $machines[name.to_s] = m.vm.data
    blk.call(m)
  end
  def method_missing(*_args, **_kw) = Anything.new
  def respond_to_missing?(*) = true
end
class MachineRec
  attr_reader :vm
  def initialize = @vm = VmRec.new({})
  def trigger = Anything.new
end
module Vagrant
  def self.configure(_version)
    top = MachineRec.new
    yield top
    $top = top.vm.data
  end
end
$machines = {}
load ARGV[0]
puts JSON.generate({ "top" => $top, "machines" => $machines })
"""


def _ruby() -> str:
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed (it comes with Debian's vagrant package)")
    return ruby


def declared(env: dict[str, str] | None = None) -> dict[str, Any]:
    """What the Vagrantfile declares, recorded by the stub DSL."""
    ruby = _ruby()
    out = subprocess.run([ruby, "-e", RECORDER, str(VAGRANTFILE)], capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**os.environ, **(env or {})}, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def provision_args(machine: dict[str, Any]) -> dict[str, str]:
    """The provision.sh options of a machine's one shell provisioner; a value the
    script looks up on the guest (``var=$(nic ADDR)``, the NIC holding ADDR) reads
    ``nic:ADDR``."""
    (prov,) = machine["provisions"]
    assert prov["type"] == "shell"
    script = prov["inline"]
    lookups = dict(re.findall(r"^(\w+)=\$\(nic (\S+)\)$", script, re.MULTILINE))
    lines = [line for line in script.splitlines() if "provision.sh" in line]
    assert len(lines) == 1, script
    argv = shlex.split(lines[0])
    assert argv[0] == "/vagrant/appliance/provision.sh"
    opts: dict[str, str] = {}
    it = iter(argv[1:])
    for flag in it:
        assert flag.startswith("--"), argv
        value = next(it)
        if value.startswith("$"):
            value = f"nic:{lookups[value[1:]]}"
        opts[flag[2:]] = value
    return opts


def nic(machine: dict[str, Any], ip: str) -> str:
    """The guest's name for the NIC holding ``ip``: Vagrant's NAT is eth0, then the
    private networks in their order (Debian's boxes keep the kernel's names)."""
    ips = [net["ip"] for net in machine["networks"]]
    return f"eth{ips.index(ip) + 1}"


def networks(machine: dict[str, Any]) -> list[ipaddress.IPv4Interface]:
    return [ipaddress.IPv4Interface(f"{net['ip']}/{net['netmask']}")
            for net in machine["networks"]]


def test_vagrant_validate(tmp_path: Path) -> None:
    vagrant = shutil.which("vagrant")
    if vagrant is None:
        pytest.skip("vagrant is not installed (apt-get install vagrant; bootstrap has it)")
    # Vagrant's state and home go to the temporary directory: nothing is written in
    # the repository (no .vagrant/) and no box is downloaded.
    env = {**os.environ, "VAGRANT_HOME": str(tmp_path / "home"),
           "VAGRANT_DOTFILE_PATH": str(tmp_path / "dot"), "VAGRANT_CWD": str(ROOT),
           "VAGRANT_CHECKPOINT_DISABLE": "1"}
    for nodes in ("2", "3"):
        run = subprocess.run([vagrant, "validate", "--ignore-provider"], capture_output=True,
                             text=True, timeout=120, env={**env, "HPCLB_NODES": nodes})
        assert run.returncode == 0, run.stdout + run.stderr
        assert "validated successfully" in run.stdout
    bad = subprocess.run([vagrant, "validate", "--ignore-provider"], capture_output=True,
                         text=True, timeout=120, env={**env, "HPCLB_NODES": "0"})
    assert bad.returncode != 0
    assert "HPCLB_NODES must be 1..9" in bad.stdout + bad.stderr
    assert not (ROOT / ".hpclb-keys").exists() or os.environ.get("HPCLB_KEEP_KEYS")
    assert not (tmp_path / "home" / "boxes").exists() or not any(
        (tmp_path / "home" / "boxes").iterdir())


def test_machines_match_the_example() -> None:
    decl = declared({"HPCLB_NODES": "2"})
    machines = decl["machines"]
    config = load_config(EXAMPLE)
    raw = yaml.safe_load(EXAMPLE.read_text())
    backends = {b.name: b for b in config.pools["nodes"].backends}
    assert list(machines) == ["gateway", *backends, "client"], "gateway first: it makes the keys"
    for name, m in machines.items():
        assert m["hostname"] == name  # the agent's node id is the host name (%l)
        assert all(net["kind"] == "private_network" for net in m["networks"])
        (sync,) = m["synced"]
        assert (sync["dst"], sync["type"]) == ("/vagrant", "rsync")
    assert decl["top"]["box"] == "debian/bookworm64"

    gw = machines["gateway"]
    gw_args = provision_args(gw)
    assert gw_args["role"] == "gateway"
    assert gw_args["config"] == "/vagrant/appliance/examples/vagrant.yaml"
    mgmt = str(config.appliance.management_address)
    assert gw_args["management-address"] == mgmt
    # The NICs by the addresses they hold, found on the guest; on Debian's boxes
    # (eth0 = Vagrant's NAT, then the networks in order) the example's names.
    assert gw_args["management"] == f"nic:{mgmt}"
    assert nic(gw, mgmt) == "eth1"
    assert gw_args["dataplane"] == raw["appliance"]["dataplane"]
    assert int(gw_args["hugepages-mb"]) == raw["appliance"]["dpdk"]["hugepages_mb"]
    assert config.telemetry is not None
    assert config.telemetry.bind.startswith(f"tcp://{mgmt}:")
    gw_nets = networks(gw)
    assert len(gw_nets) == 3, "a management NIC and two data NICs"
    front, cluster = gw_nets[1], gw_nets[2]
    ingress, egress = config.appliance.interfaces.ingress, config.appliance.interfaces.egress
    assert gw_args["ingress"] == f"nic:{front.ip}" and ingress == nic(gw, str(front.ip))
    assert gw_args["egress"] == f"nic:{cluster.ip}" and list(egress) == [
        nic(gw, str(cluster.ip))]
    # Memory for the hugepages on top of the system's, the same on both providers;
    # virtio NICs (native XDP) on both.
    libvirt, vbox = gw["providers"]["libvirt"], gw["providers"]["virtualbox"]
    assert libvirt["memory"] == vbox["memory"] >= 2048 + int(gw_args["hugepages-mb"])
    assert libvirt["cpus"] == vbox["cpus"] >= 2, "DPDK: a main lcore and a worker"
    assert libvirt["nic_model_type"] == "virtio"
    assert vbox["customize"] == [["modifyvm", "id", f"--nictype{n}", "virtio"]
                                 for n in range(2, len(gw_nets) + 2)]

    keys_dir = gw_args["keys-dir"]
    for name, backend in backends.items():
        m = machines[name]
        args = provision_args(m)
        assert args["role"] == "node"
        assert args["config"] == gw_args["config"]
        assert args["gateway"] == mgmt
        assert args["keys-dir"] == keys_dir
        nets = networks(m)
        on_cluster = [n for n in nets if n.network == cluster.network]
        assert [n.ip for n in on_cluster] == [backend.address], name
        assert backend.via == egress[0]
        # DSR: the node answers clients directly, on the front network.
        assert any(n.network == front.network for n in nets), name
        assert any(n.network == gw_nets[0].network for n in nets), "telemetry path"

    client = machines["client"]
    c_args = provision_args(client)
    assert c_args["role"] == "client"
    assert c_args["gateway"] == str(front.ip)
    c_nets = networks(client)
    assert any(n.network == front.network for n in c_nets)
    assert not any(n.network == cluster.network for n in c_nets), "only via the gateway"
    for vip in config.vips:
        # Routed through the gateway: on none of the Vagrant networks.
        assert not any(vip.address in n.network for n in gw_nets + c_nets)

    # Each machine's copy of the keys directory lacks every secret it must not hold.
    rel = keys_dir.removeprefix("/vagrant/")
    for name, m in machines.items():
        excluded = set(m["synced"][0]["rsync__exclude"])
        own = "server" if name == "gateway" else name
        for other in ("server", *backends):
            secret = f"{rel}/{other}.key_secret"
            assert (secret in excluded) == (other != own), (name, other)


def test_more_nodes_get_a_generated_configuration(tmp_path: Path) -> None:
    decl = declared({"HPCLB_NODES": "3"})
    machines = decl["machines"]
    assert list(machines) == ["gateway", "node1", "node2", "node3", "client"]
    cfg = provision_args(machines["gateway"])["config"]
    assert cfg == "/vagrant/.hpclb-keys/vagrant.yaml"
    assert all(provision_args(machines[n])["config"] == cfg for n in ("node1", "node3"))
    # The host-side step writes it (with the keys) before the first machine boots.
    root = _prepare(tmp_path, nodes=3)
    written = load_config(root / ".hpclb-keys" / "vagrant.yaml")
    assert [(b.name, str(b.address), b.via) for b in written.pools["nodes"].backends] == [
        (f"node{i}", f"10.98.2.{20 + i}", "eth3") for i in (1, 2, 3)]
    assert str(machines["node3"]["networks"][2]["ip"]) == "10.98.2.23"


def _prepare(tmp_path: Path, nodes: int) -> Path:
    """Run the Vagrantfile's host-side step (HpclbKeys.prepare) on a copy of the example."""
    ruby = _ruby()
    root = tmp_path / "repo"
    (root / "appliance" / "examples").mkdir(parents=True)
    shutil.copy(EXAMPLE, root / "appliance" / "examples" / "vagrant.yaml")
    script = ("module Vagrant; def self.configure(*) = nil; end; load ARGV[0]; "
              "HpclbKeys.prepare(ARGV[1])")
    subprocess.run([ruby, "-e", script, str(VAGRANTFILE), str(root)], check=True,
                   timeout=60, env={**os.environ, "HPCLB_NODES": str(nodes)})
    return root


def test_host_made_keys_are_pyzmq_certificates(tmp_path: Path) -> None:
    """The keys the Vagrantfile makes on the host load as `hpclb-agent keygen`'s do,
    and each secret matches its public half; a second run keeps them."""
    root = _prepare(tmp_path, nodes=2)
    keys = root / ".hpclb-keys"
    names = ("server", "node1", "node2")
    assert sorted(p.name for p in keys.iterdir()) == sorted(
        f"{n}.{ext}" for n in names for ext in ("key", "key_secret"))
    publics = set()
    for name in names:
        public, none = zmq.auth.load_certificate(keys / f"{name}.key")
        assert none is None
        public2, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        assert public2 == public and secret is not None
        assert zmq.curve_public(secret) == public
        assert (keys / f"{name}.key_secret").stat().st_mode & 0o777 == 0o600
        assert (keys / f"{name}.key").stat().st_mode & 0o777 == 0o644
        publics.add(public)
    assert len(publics) == len(names)
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    _prepare_again = subprocess.run(
        [_ruby(), "-e", "module Vagrant; def self.configure(*) = nil; end; load ARGV[0]; "
         "HpclbKeys.prepare(ARGV[1])", str(VAGRANTFILE), str(root)],
        check=True, timeout=60, env={**os.environ, "HPCLB_NODES": "2"})
    assert _prepare_again.returncode == 0
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before


def test_provisioning_scripts_parse_and_find_nics() -> None:
    """Each machine's script is valid bash (shellcheck-clean where shellcheck is
    installed), and its NIC lookup names the NIC holding an address (here lo's)."""
    machines = declared({"HPCLB_NODES": "2"})["machines"]
    shellcheck = shutil.which("shellcheck")
    for name, m in machines.items():
        script = m["provisions"][0]["inline"]
        subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)
        if shellcheck:
            res = subprocess.run([shellcheck, "-s", "bash", "-"], input=script, text=True,
                                 capture_output=True, timeout=60)
            assert res.returncode == 0, (name, res.stdout)
    gateway = machines["gateway"]["provisions"][0]["inline"]
    function = gateway[gateway.index("nic() {"):gateway.index("\n}\n") + 3]
    found = subprocess.run(["bash", "-c", f"set -eu\n{function}nic 127.0.0.1"],
                           capture_output=True, text=True, timeout=30)
    assert (found.returncode, found.stdout) == (0, "lo\n")
    missing = subprocess.run(["bash", "-c", f"set -eu\n{function}x=$(nic 192.0.2.254)\necho $x"],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "no NIC holds 192.0.2.254" in missing.stderr
