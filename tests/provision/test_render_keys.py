"""The configuration rendered from an example, and the keypair repaired."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
import zmq.auth

from hpclb.provision.keys import CurveKeypair
from hpclb.provision.plan import Context, ProvisionError, run_plan
from hpclb.provision.render import ConfigInputs, render_config
from tests.provision.conftest import HASH_KEY, REPO

EXAMPLE = REPO / "appliance/examples/gateway.yaml"


def test_render_keeps_the_examples_comments_and_follows_renamed_ports() -> None:
    text = render_config(EXAMPLE.read_text(), str(EXAMPLE), ConfigInputs(
        name="gw7", hash_key=HASH_KEY, dataplane="xdp", ingress="eth1",
        egress=["eth2", "eth3"], management_address="192.168.56.10"))
    example_comments = [line.split("#", 1)[1] for line in EXAMPLE.read_text().splitlines()
                        if line.lstrip().startswith("#")]
    rendered_comments = [line.split("#", 1)[1] for line in text.splitlines()
                         if line.lstrip().startswith("#")]
    assert rendered_comments == example_comments  # every comment line, in order
    cfg = yaml.safe_load(text)
    assert cfg["appliance"]["interfaces"] == {"ingress": "eth1", "egress": ["eth2", "eth3"]}
    vias = {b["name"]: b.get("via") for p in cfg["pools"].values() for b in p["backends"]}
    assert vias["cn101"] == "eth2" and vias["cn201"] == "eth3"  # ens1f1 -> eth2, ens2f0 -> eth3
    assert cfg["telemetry"]["bind"] == "tcp://192.168.56.10:5557"
    assert "  egress: [eth2, eth3]" in text  # the flow style of the example stays


def test_render_names_the_problem_of_a_port_the_backends_do_not_follow() -> None:
    with pytest.raises(ProvisionError) as err:
        render_config(EXAMPLE.read_text(), str(EXAMPLE), ConfigInputs(
            name="gw7", hash_key=HASH_KEY, egress=["eth2"]))
    assert "as rendered for this host" in str(err.value)
    assert "'ens1f1' is not an egress interface" in str(err.value)


def test_a_missing_public_key_is_written_again_from_the_secret(root: Path) -> None:
    ctx = Context(root=root, live=False, check=False, src=REPO, out=lambda _: None)
    (root / "etc").mkdir()
    (root / "etc/group").write_text("hpclb:x:990:\n")
    pair = CurveKeypair()
    run_plan([pair], ctx)
    public = root / "etc/hpclb/curve/server.key"
    key = zmq.auth.load_certificate(public)[0]
    public.unlink()
    (root / "etc/hpclb/curve/server.key_secret").chmod(0o644)
    assert pair.pending(ctx) == [
        "/etc/hpclb/curve/server.key: write from the secret key",
        "/etc/hpclb/curve/server.key_secret: mode 0644 -> 0640"]
    run_plan([pair], ctx)
    assert zmq.auth.load_certificate(public)[0] == key
    assert pair.pending(ctx) == []
