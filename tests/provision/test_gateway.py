"""The gateway's provisioning into a fresh --root tree: twice (the second run
changes nothing), --check, an existing configuration kept, a broken example,
a refused NIC, the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
import zmq.auth

from hpclb.provision.actions import gid, uid
from hpclb.provision.gateway import unit_actions
from hpclb.provision.plan import Context, Note
from tests.provision.conftest import HASH_KEY, NAME, REPO, snapshot


def _gateway(provision, root: Path, *extra: str):
    return provision("gateway", "--root", str(root), "--name", NAME, *extra)


def test_fresh_root_twice_second_run_changes_nothing(provision, root: Path,
                                                     sysfs: Path) -> None:
    first = _gateway(provision, root, "--sysfs", str(sysfs), "--dataplane", "dpdk")
    assert first.rc == 0, first.err
    assert first.summary.startswith("provision: ") and first.summary.endswith(" changes")
    before = snapshot(root)
    second = _gateway(provision, root, "--sysfs", str(sysfs), "--dataplane", "dpdk")
    assert second.rc == 0, second.err
    assert second.summary == "provision: no change"
    assert not [line for line in second.lines if line.startswith("changed:")]
    assert "kept: /etc/hpclb/hpclb.yaml (it exists; provisioning never overwrites it)" \
        in second.lines
    assert snapshot(root) == before  # byte for byte, modes and owners


def test_what_a_gateway_gets(provision, root: Path, sysfs: Path) -> None:
    assert _gateway(provision, root, "--sysfs", str(sysfs), "--dataplane", "dpdk").rc == 0
    hpclb_uid, hpclb_gid = uid_gid(root)
    assert hpclb_uid > 0 and hpclb_gid > 0
    config = root / "etc/hpclb/hpclb.yaml"
    st = config.stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o660, 0, hpclb_gid)
    st = (root / "etc/hpclb").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o770, 0, hpclb_gid)
    app = yaml.safe_load(config.read_text())["appliance"]
    assert app["name"] == NAME and app["hash_key"] == HASH_KEY
    # The fake host's NICs, bound for DPDK: PCI addresses, workers on their node.
    assert app["dataplane"] == "dpdk"
    assert app["interfaces"] == {"ingress": "0000:3b:00.0",
                                 "egress": ["0000:3b:00.1", "0000:af:00.0"]}
    assert 0 not in app["dpdk"]["lcores"][1:]
    assert set(app["dpdk"]["lcores"]) <= {0, 1, 2, 3}  # NUMA node 0: two of three ports
    # Units installed and enabled (the [Install] links), none started under --root.
    wants = root / "etc/systemd/system/multi-user.target.wants"
    assert (wants / "hpclb.service").is_symlink()
    for unit in (REPO / "appliance/systemd").glob("*.service"):
        assert (root / "etc/systemd/system" / unit.name).read_bytes() == unit.read_bytes()
    first_lines = (root / "usr/local/bin/hpclb").readlink()
    assert first_lines == Path("/opt/hpclb/.venv/bin/hpclb")


def uid_gid(root: Path) -> tuple[int, int]:
    ctx = Context(root=root, live=False, check=False, src=REPO)
    u, g = uid(ctx, "hpclb"), gid(ctx, "hpclb")
    assert u is not None and g is not None
    return u, g


def test_rendered_configuration_passes_hpclb_check(provision, root: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert _gateway(provision, root).rc == 0
    from hpclb.main import main as hpclb

    config = root / "etc/hpclb/hpclb.yaml"
    assert hpclb(["check", "--schema-only", "-c", str(config)]) == 0
    assert f"{config}: schema ok" in capsys.readouterr().out


def test_check_on_a_fresh_tree_changes_nothing_and_lists_the_changes(
        provision, root: Path, sysfs: Path) -> None:
    result = _gateway(provision, root, "--check", "--sysfs", str(sysfs))
    assert result.rc == 0, result.err
    assert list(root.iterdir()) == []
    would = [line for line in result.lines if line.startswith("would change: ")]
    for what in ("users from /usr/lib/sysusers.d/hpclb.conf", "write /etc/hpclb/hpclb.yaml",
                 "CURVE keypair", "write /etc/systemd/system/hpclb.service",
                 "enable hpclb.service", "write /etc/sysctl.d/60-hpclb-gateway.conf"):
        assert any(what in line for line in would), what
    assert result.summary == f"provision: {len(would)} changes would be made (--check)"
    # And after a real run, --check finds nothing.
    assert _gateway(provision, root, "--sysfs", str(sysfs)).rc == 0
    after = _gateway(provision, root, "--check", "--sysfs", str(sysfs))
    assert after.summary == "provision: no change"


def test_an_existing_configuration_is_kept(provision, root: Path) -> None:
    config = root / "etc/hpclb/hpclb.yaml"
    config.parent.mkdir(parents=True)
    mine = (REPO / "appliance/examples/lab.yaml").read_text() + "# the operator's\n"
    config.write_text(mine)
    result = _gateway(provision, root)
    assert result.rc == 0, result.err
    assert config.read_text() == mine
    assert any(line.startswith("kept: /etc/hpclb/hpclb.yaml") for line in result.lines)


def test_the_bgp_speaker_is_enabled_only_where_the_configuration_announces(
        provision, root: Path, tmp_path: Path) -> None:
    """hpclb-bird.path (which starts BIRD once hpclb has written its
    configuration) is installed everywhere and enabled only with a `bgp:`
    section."""
    wants = root / "etc/systemd/system/multi-user.target.wants"
    assert _gateway(provision, root).rc == 0
    assert (root / "etc/systemd/system/hpclb-bird.path").is_file()
    assert not (wants / "hpclb-bird.path").exists()
    other = tmp_path / "bgp-root"
    other.mkdir()
    config = other / "etc/hpclb/hpclb.yaml"
    config.parent.mkdir(parents=True)
    config.write_text((REPO / "appliance/examples/lab.yaml").read_text() + (
        "bgp:\n  local_asn: 65001\n  router_id: 10.99.0.1\n"
        "  peers: [{name: tor1, address: 10.99.0.2, asn: 65000}]\n"))
    result = _gateway(provision, other)
    assert result.rc == 0, result.err
    assert (other / "etc/systemd/system/multi-user.target.wants/hpclb-bird.path").is_symlink()


def test_an_active_standby_member_gets_keepalived_files_and_unit(
        provision, root: Path) -> None:
    """With a `vrrp:` section: keepalived's configuration (0644) and track
    script (0700, root's: keepalived's script security) rendered from the
    configuration in force, and hpclb-keepalived.service enabled; without
    one, the unit is installed but not enabled and no file is written. A
    changed section is rendered again on the next run."""
    wants = root / "etc/systemd/system/multi-user.target.wants"
    conf, script = root / "etc/keepalived/hpclb.conf", root / "etc/keepalived/hpclb-vrrp-check.sh"
    assert _gateway(provision, root).rc == 0
    assert (root / "etc/systemd/system/hpclb-keepalived.service").is_file()
    assert not (wants / "hpclb-keepalived.service").exists() and not conf.exists()

    config = root / "etc/hpclb/hpclb.yaml"
    config.write_text(config.read_text() + (
        "vrrp:\n  role: standby\n  next_hop: 198.18.0.1\n  advert_int: 0.5\n"))
    result = _gateway(provision, root)
    assert result.rc == 0, result.err
    assert (wants / "hpclb-keepalived.service").is_symlink()
    assert conf.stat().st_mode & 0o777 == 0o644 and script.stat().st_mode & 0o777 == 0o700
    text = conf.read_text()
    assert "198.18.0.1/24" in text and "priority 100" in text and "advert_int 0.5" in text
    assert 'script "/etc/keepalived/hpclb-vrrp-check.sh"' in text
    assert f"/run/hpclb/{NAME}.status.json" in script.read_text()

    config.write_text(config.read_text().replace("role: standby", "role: active"))
    again = _gateway(provision, root)
    assert again.rc == 0, again.err
    assert "priority 150" in conf.read_text()
    assert any("/etc/keepalived/hpclb.conf" in line for line in again.lines)


def test_a_broken_example_is_a_clear_error_and_changes_nothing(
        provision, root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    text = (REPO / "appliance/examples/gateway.yaml").read_text()
    broken.write_text(text.replace("ring_size: 131071", "ring_size: 131072"))
    result = _gateway(provision, root, "--config", str(broken))
    assert result.rc == 1
    assert f"{broken} is not a valid configuration" in result.err
    assert "appliance.ring_size" in result.err and "131072" in result.err
    assert list(root.iterdir()) == []
    missing = _gateway(provision, root, "--config", str(tmp_path / "nope.yaml"))
    assert missing.rc == 1 and "nope.yaml" in missing.err
    assert list(root.iterdir()) == []


def test_binding_the_management_nic_is_refused_and_nothing_changes(
        provision, root: Path, sysfs: Path) -> None:
    result = _gateway(provision, root, "--sysfs", str(sysfs), "--dataplane", "dpdk",
                      "--management", "ens1f0")
    assert result.rc == 3
    assert "refused" in result.err and "management NIC" in result.err
    assert list(root.iterdir()) == []


def test_keys(provision, root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    zmq.auth.create_certificates(keys, "node01")
    (keys / "node01.key_secret").unlink()  # a node shares only its public half
    assert _gateway(provision, root, "--keys-dir", str(keys)).rc == 0
    _, hpclb_gid = uid_gid(root)
    curve = root / "etc/hpclb/curve"
    public, secret = zmq.auth.load_certificate(curve / "server.key_secret")
    assert secret is not None
    assert zmq.auth.load_certificate(curve / "server.key") == (public, None)
    st = (curve / "server.key_secret").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, 0, hpclb_gid)
    assert (keys / "server.key").read_bytes() == (curve / "server.key").read_bytes()
    assert (curve / "agents/node01.key").read_bytes() == (keys / "node01.key").read_bytes()
    # Never replaced: a second run keeps the pair the agents trust.
    assert _gateway(provision, root, "--keys-dir", str(keys)).summary == "provision: no change"
    assert zmq.auth.load_certificate(curve / "server.key_secret")[0] == public


def test_a_pair_made_beforehand_is_installed(provision, root: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    zmq.auth.create_certificates(keys, "server")
    assert _gateway(provision, root, "--keys-dir", str(keys)).rc == 0
    curve = root / "etc/hpclb/curve"
    assert (curve / "server.key_secret").read_bytes() == (keys / "server.key_secret").read_bytes()
    assert not (curve / "agents/server.key").exists()


def test_where_systemd_does_not_run_the_plan_says_so_and_stops(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpclb.provision import gateway

    monkeypatch.setattr(gateway, "systemd_running", lambda ctx: False)
    ctx = Context(root=root, live=True, check=False, src=REPO)  # planned, never run
    actions = unit_actions(ctx, ["hpclb.service"])
    assert isinstance(actions[-1], Note)
    assert "systemd is not running" in actions[-1].line and "stopping here" in actions[-1].line
    assert not [a for a in actions if a.describe().startswith("start ")]
