"""Configuration models and loader: examples load, every error names file, line and field."""

from __future__ import annotations

import re
from ipaddress import IPv4Address
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.config import (
    MAX_CONFIG_BYTES,
    AdminState,
    ConfigError,
    HpclbConfig,
    VipProtocol,
    load_config,
    parse_config,
)
from hpclb.config import loader as config_loader
from hpclb.contract.tables import MAX_BACKENDS, MAX_VIPS

from .config_cases import EXAMPLES

BASE = """\
appliance:
  name: gw1
  dataplane: auto
  interfaces:
    ingress: eth0
    egress: [eth1]
  hash_key: 000102030405060708090a0b0c0d0e0f
  ring_size: 65537
pools:
  web:
    weights: static
    backends:
      - name: b1
        address: 198.18.0.11
        weight: 1
        via: eth1
      - name: b2
        address: 198.18.0.12
vips:
  - name: svc
    address: 198.18.1.10
    port: 8080
    protocol: tcp
    mode: dsr
    pool: web
"""
LINES = BASE.splitlines()


def edit(line: int, new: str | None) -> str:
    """BASE with 1-based `line` replaced by `new` (removed when None)."""
    lines = list(LINES)
    if new is None:
        del lines[line - 1]
    else:
        lines[line - 1] = new
    return "\n".join(lines) + "\n"


def error(text: str, source: str = "t.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source)
    return str(info.value)


def test_base_is_valid() -> None:
    cfg = parse_config(BASE, "t.yaml")
    assert cfg.appliance.hash_key_bytes == bytes(range(16))
    assert cfg.appliance.xdp.flow_table_size == 1048576
    assert cfg.appliance.control_socket == "ipc:///run/hpclb/dataplane.sock"
    b1, b2 = cfg.pools["web"].backends
    assert b1.address == IPv4Address("198.18.0.11") and b1.via == "eth1"
    assert b2.weight == 1.0 and b2.mac is None and b2.state is AdminState.UP
    assert cfg.vips[0].protocol is VipProtocol.TCP and cfg.vips[0].protocol.number == 6


@pytest.mark.parametrize("name", ["lab.yaml", "gateway.yaml", "nat.yaml", "tunnel.yaml",
                                  "dualstack.yaml"])
def test_examples_load(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert cfg.vips and cfg.pools
    assert all(v.pool in cfg.pools for v in cfg.vips)
    assert len(cfg.appliance.hash_key_bytes) == 16


def test_example_round_trips_through_model_dump() -> None:
    cfg = load_config(EXAMPLES / "gateway.yaml")
    again = HpclbConfig.model_validate(cfg.model_dump(mode="json"))
    assert again == cfg


@pytest.mark.parametrize(
    ("line", "new", "where", "path", "words"),
    [
        # syntax error
        (2, "  name: gw1: x", "t.yaml:2:12:", "", "mapping values are not allowed"),
        # unknown key (with a suggestion)
        (8, "  ring_sise: 65537", "t.yaml:8:", "appliance.ring_sise", "did you mean 'ring_size'"),
        (19, "vip:", "t.yaml:19:", "vip", "unknown key"),
        # wrong type
        (22, "    port: http", "t.yaml:22:11:", "vips[0].port", "valid integer"),
        (15, "        weight: yes", "t.yaml:15:", "pools.web.backends[0].weight", "valid number"),
        (22, "    port: 70000", "t.yaml:22:", "vips[0].port", "less than or equal to 65535"),
        # bad IP
        (14, "        address: 198.18.0.300", "t.yaml:14:18:", "backends[0].address", "IPv4"),
        (21, "    address: 2001:db8::zz", "t.yaml:21:", "vips[0].address", "IPv4 or IPv6"),
        # bad hash key
        (7, "  hash_key: 00aa", "t.yaml:7:", "appliance.hash_key", "32 hex digits"),
        (7, "  hash_key: 000102030405060708090a0b0c0d0e0g", "t.yaml:7:", "hash_key", "hex"),
        (7, "  hash_key: 12345678901234567890123456789012", "t.yaml:7:", "hash_key", "quote it"),
        (7, "  hash_key: 0011", "t.yaml:7:", "hash_key", "quote it"),  # YAML 1.1 octal
        # ring size
        (8, "  ring_size: 65536", "t.yaml:8:", "appliance.ring_size", "prime"),
        (8, "  ring_size: 2000003", "t.yaml:8:", "appliance.ring_size", "between 3 and 1048573"),
        # unknown pool
        (25, "    pool: api", "t.yaml:25:", "vips[0].pool", "unknown pool 'api'"),
        # duplicate backend name
        (17, "      - name: b1", "t.yaml:17:", "pools.web.backends[1].name", "already defined"),
        # bad via
        (16, "        via: eth9", "t.yaml:16:", "backends[0].via", "not an egress interface"),
        # negative weight
        (15, "        weight: -0.5", "t.yaml:15:", "backends[0].weight", "greater than or equal"),
        (15, "        weight: .inf", "t.yaml:15:", "backends[0].weight", "finite"),
        # modes and enums
        (24, "    mode: nat", "t.yaml:24:", "vips[0].mode", "b2 on the ingress interface eth0"),
        (24, "    mode: tunnel", "t.yaml:24:", "vips[0].mode", "needs the outer source prefix"),
        (24, "    mode: dsr\n    tunnel: {source: 10.9.0.0/24}", "t.yaml:25:", "vips[0].tunnel",
         "only a tunnel VIP (mode: tunnel) encapsulates"),
        (23, "    protocol: sctp", "t.yaml:23:", "vips[0].protocol", "'tcp' or 'udp'"),
        (11, "    weights: adaptive", "t.yaml:11:", "pools.web.weights", "'static' or 'dynamic'"),
        (3, "  dataplane: vpp", "t.yaml:3:", "appliance.dataplane", "'auto', 'xdp' or 'dpdk'"),
        # interfaces
        (6, "    egress: [eth1, eth0]", "t.yaml:6:", "egress[1]", "is the ingress interface"),
        (6, "    egress: [eth1, eth1]", "t.yaml:6:", "egress[1]", "listed twice"),
        # missing field: reported on the line of the mapping that lacks it
        (5, None, "t.yaml:4:", "appliance.interfaces.ingress", "Field required"),
        # duplicate YAML key
        (3, "  name: gw2", "t.yaml:3:3:", "appliance.name", "duplicate key"),
        # names
        (13, "      - name: 'b 1'", "t.yaml:13:", "backends[0].name", "pattern"),
    ],
)
def test_error_names_line_and_field(
    line: int, new: str | None, where: str, path: str, words: str
) -> None:
    message = error(edit(line, new))
    first = message.splitlines()[0]
    assert first.startswith(where), message
    assert path in first and words in first, message


def test_duplicate_vip_and_vip_name() -> None:
    text = BASE + "  - {name: svc, address: 198.18.1.10, port: 8080, pool: web}\n"
    message = error(text)
    assert "t.yaml:26:" in message
    assert "vips[1]: 198.18.1.10:8080/tcp already used by vips[0]" in message
    assert "vips[1].name: VIP name 'svc' already used by vips[0]" in message
    # same address and port over another protocol is a different VIP
    parse_config(
        BASE + "  - {name: dns, address: 198.18.1.10, port: 8080, protocol: udp, pool: web}\n"
    )


def test_duplicate_backend_across_pools() -> None:
    text = edit(19, "  db:\n    backends:\n      - {name: b2, address: 198.18.0.13}\nvips:")
    message = error(text)
    assert message.startswith("t.yaml:21:"), message
    assert (
        "pools.db.backends[0].name: backend 'b2' already defined at pools.web.backends[1]"
        in message
    )


def test_mac_normalised_and_checked() -> None:
    cfg = parse_config(edit(18, "        address: 198.18.0.12\n        mac: AA-BB-CC-DD-EE-02"))
    assert cfg.pools["web"].backends[1].mac == "aa:bb:cc:dd:ee:02"
    cfg = parse_config(edit(18, "        address: 198.18.0.12\n        mac: aabbccddee02"))
    assert cfg.pools["web"].backends[1].mac == "aa:bb:cc:dd:ee:02"
    # YAML 1.1 reads 10:20:30:40:50:59 as a base-60 integer
    message = error(edit(18, "        address: 198.18.0.12\n        mac: 10:20:30:40:50:59"))
    assert message.startswith("t.yaml:19:") and "quote it" in message, message
    message = error(edit(18, "        address: 198.18.0.12\n        mac: 'ff:ff:ff:ff:ff:ff'"))
    assert message.startswith("t.yaml:19:") and "unicast" in message, message
    message = error(edit(18, "        address: 198.18.0.12\n        mac: 'aa:bb:cc'"))
    assert "pools.web.backends[1].mac: not a MAC address" in message, message


def test_every_error_reported_one_per_line_in_order() -> None:
    text = edit(22, "    port: 0")
    text = text.replace("weight: 1", "weight: -1").replace("ring_size: 65537", "ring_size: 9")
    lines = error(text).splitlines()
    assert [int(m.split(":")[1]) for m in lines] == [8, 15, 22], lines


def test_too_many_vips() -> None:
    extra = "".join(
        f"  - {{name: v{i}, address: 198.18.1.10, port: {1000 + i}, pool: web}}\n"
        for i in range(MAX_VIPS)
    )
    message = error(BASE + extra)
    assert message.startswith("t.yaml:19:1: vips: List should have at most 64 items"), message
    parse_config(BASE + extra.split("\n", 1)[1])  # exactly 64 is fine


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("", "t.yaml:1: configuration is empty"),
        ("- 1\n- 2\n", "t.yaml:1:1: (top level): Input should be a valid dictionary"),
        ("a: 1\n---\nb: 2\n", "t.yaml:2:1: expected a single document"),
        ("a: [1,\n", "t.yaml:2:1:"),
        ("appliance: !!int abc\n", "t.yaml:1:12: cannot read 'abc'"),
        ("a: \x01\n", "t.yaml:1: unacceptable character #x0001"),
        ("? [a]\n: 1\n", "t.yaml:1:3: while constructing a mapping; found unhashable key"),
        ("[" * 5000, "t.yaml: nesting too deep"),
    ],
)
def test_yaml_level_errors(text: str, start: str) -> None:
    message = error(text)
    assert message.startswith(start), message


def test_aliases_and_merge_keys() -> None:
    text = BASE.replace("      - name: b2\n", "      - &b2\n        name: b2\n")
    text += "  - {name: svc2, address: 198.18.1.11, port: 8080, pool: web}\n"
    assert parse_config(text).vips[1].address == IPv4Address("198.18.1.11")
    merged = BASE.replace(
        "      - name: b1\n", "      - <<: {weight: 3, name: x}\n        name: b1\n"
    )
    assert parse_config(merged).pools["web"].backends[0].weight == 1.0  # own key wins
    message = error(BASE + "x: &x [*x]\n")  # a recursive alias neither hangs nor crashes
    assert "t.yaml:26:1: x: unknown key" in message, message


def test_load_config_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"{missing}: cannot read")):
        load_config(missing)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read")):
        load_config(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=re.escape(f"{binary}: cannot read")):
        load_config(binary)
    bad = tmp_path / "lab.yaml"
    bad.write_text(edit(22, "    port: 65536"))
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value) == (
        f"{bad}:22:11: vips[0].port: Input should be less than or equal to 65535 (got 65536)"
    )
    assert info.value.issues[0].line == 22 and info.value.issues[0].path == "vips[0].port"


def test_plain_message_error() -> None:
    assert str(ConfigError("no such pool")) == "no such pool"


def _check(text: str) -> None:
    try:
        parse_config(text, "f.yaml")
    except ConfigError as exc:
        assert exc.issues
        # YAML's line breaks, not only "\n": a lone "\r" (or NEL, LS, PS) starts
        # a line too, and the loader reports lines as YAML counts them.
        nlines = len(re.split("\r\n|[\r\n\x85\u2028\u2029]", text))
        for issue in exc.issues:
            assert str(issue).startswith("f.yaml")
            assert issue.line is None or 1 <= issue.line <= nlines + 1


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_random_text(text: str) -> None:
    _check(text)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_config(data: st.DataObject) -> None:
    text = BASE
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 8)))
        text = (
            text[:i]
            + data.draw(st.text("-:{}[]&*!|>'\"# \n0123456789abx.,?%@`", max_size=6))
            + text[j:]
        )
    _check(text)


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_trees = st.recursive(
    _scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["appliance", "pools", "vips", "x"]), _trees))
def test_fuzz_structured(tree: dict[str, object]) -> None:
    _check(yaml.safe_dump(tree))


SERVICES = """\
appliance:
  name: t
  interfaces: {ingress: eth0}
  hash_key: 000102030405060708090a0b0c0d0e0f
  APPLIANCE_EXTRA
telemetry: {server_key: /k/server.key_secret, allow_dir: /k/agents, TELEMETRY_EXTRA}
pools: {p: {backends: [{name: n1, address: 10.0.0.11}]}}
vips: [{name: v, address: 10.1.1.10, port: 80, pool: p}]
"""


def services(appliance: str = "", telemetry: str = "") -> str:
    return (SERVICES.replace("APPLIANCE_EXTRA", appliance or "netns: null")
            .replace(", TELEMETRY_EXTRA", f", {telemetry}" if telemetry else ""))


@pytest.mark.parametrize("appliance, telemetry, message", [
    ("", "", "telemetry.bind: no address for the telemetry service"),
    ("", "bind: 'tcp://0.0.0.0:5557'", "0.0.0.0 is a wildcard"),
    ("", "bind: 'tcp://*:5557'", "is not an IPv4 address"),
    ("", "bind: 'tcp://10.1.1.10:5557'", "10.1.1.10 is a VIP"),
    ("management_address: 10.1.1.10", "", "appliance.management_address: 10.1.1.10 is a VIP"),
    ("{management_address: 10.0.0.5, metrics: '0.0.0.0:9108'}".strip("{}"), "",
     "appliance.metrics: 0.0.0.0 is a wildcard"),
])
def test_services_never_bind_a_wildcard_or_a_vip(appliance: str, telemetry: str,
                                                 message: str) -> None:
    """The telemetry receiver and the exporter listen on one address of the
    appliance's: a wildcard (every VIP the kernel holds) or a VIP would let
    clients reach them through the VIP."""
    text = services(appliance.replace(", ", "\n  "), telemetry)
    with pytest.raises(ConfigError) as err:
        parse_config(text, "s.yaml")
    assert message in str(err.value)


def test_services_default_to_the_management_address() -> None:
    cfg = parse_config(services("management_address: 10.0.0.5\n  metrics: ':9108'"), "s.yaml")
    assert cfg.telemetry is not None
    assert cfg.telemetry.endpoint(cfg.appliance.management_address) == "tcp://10.0.0.5:5557"
    assert cfg.appliance.metrics_endpoint == ("10.0.0.5", 9108)
    cfg = parse_config(services("", "bind: 'tcp://10.0.0.6:7000'"), "s.yaml")
    assert cfg.telemetry is not None
    assert cfg.telemetry.endpoint(cfg.appliance.management_address) == "tcp://10.0.0.6:7000"


def many_backends(n: int, per_pool: int = 256) -> str:
    """A configuration of n backends (name, address, weight, MAC) in pools of
    per_pool, each pool behind a VIP of its own."""
    out = [BASE.split("pools:")[0].replace("    egress: [eth1]\n", ""), "pools:\n"]
    pools = (n + per_pool - 1) // per_pool
    for p in range(pools):
        out.append(f"  p{p}:\n    backends:\n")
        for i in range(p * per_pool, min(n, (p + 1) * per_pool)):
            out.append(f"      - {{name: cn{i}, address: 10.1.{i >> 8}.{i & 255}, weight: 2, "
                       f"mac: '02:00:00:00:{i >> 8:02x}:{i & 255:02x}'}}\n")
    out.append("vips:\n")
    out += [f"  - {{name: v{p}, address: 198.18.1.{p + 1}, port: 80, pool: p{p}}}\n"
            for p in range(pools)]
    return "".join(out)


def test_a_configuration_at_the_backend_limit_loads(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(many_backends(MAX_BACKENDS))
    cfg = load_config(path)
    backends = [b for pool in cfg.pools.values() for b in pool.backends]
    assert len(backends) == MAX_BACKENDS == 4096
    assert backends[-1].name == "cn4095" and backends[-1].mac == "02:00:00:00:0f:ff"
    assert len(cfg.vips) == 16
    # ... and one over it is refused, on the line of the pool that has one too many
    message = error(many_backends(MAX_BACKENDS + 1), "big.yaml")
    assert message == f"big.yaml:8:1: pools: 4097 backends, at most {MAX_BACKENDS}", message


def test_an_oversized_file_is_refused_before_parsing(tmp_path: Path) -> None:
    text = many_backends(16)
    padded = text + "#" * (MAX_CONFIG_BYTES - len(text)) + "\n"  # one byte too many
    path = tmp_path / "huge.yaml"
    path.write_text(padded)
    limit = f"over the limit of {MAX_CONFIG_BYTES} bytes (4 MiB)"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: configuration too large: {MAX_CONFIG_BYTES + 1} bytes, {limit}")
    assert error(padded, "t.yaml") == (
        f"t.yaml: configuration too large: {MAX_CONFIG_BYTES + 1} bytes, {limit}")
    # a multi-byte character counts for its bytes
    assert "too large" in error(text + "#" + "é" * (MAX_CONFIG_BYTES // 2))
    # what is not a regular file is read no further than the limit
    with pytest.raises(ConfigError) as info:
        load_config("/dev/zero")
    assert str(info.value) == f"/dev/zero: configuration too large: {limit}"
    path.write_text(padded[:MAX_CONFIG_BYTES - 1] + "\n")  # at the limit: parsed
    assert len(load_config(path).pools) == 1


def _outcome(text: str, fast: bool) -> str:
    saved = config_loader._FastLoader
    if not fast:
        config_loader._FastLoader = None
    try:
        return parse_config(text, "f.yaml").model_dump_json()
    except ConfigError as exc:
        return "refused:" + "\n".join(f"{i.line}:{i.path}" for i in exc.issues)
    finally:
        config_loader._FastLoader = saved


@pytest.mark.skipif(config_loader._FastLoader is None, reason="PyYAML without libyaml")
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_libyaml_and_the_reference_loader_agree(data: st.DataObject) -> None:
    """libyaml parses; the pure-Python loader is the reference, which reports
    YAML errors and judges any text with a tab. A file one accepts the other
    accepts alike, and one it refuses the other refuses, with the same lines
    and fields unless libyaml reads as YAML what PyYAML refuses as broken."""
    text = BASE
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        j = data.draw(st.integers(i, min(len(text), i + 8)))
        noise = data.draw(st.text("-:{}[]&*!|>'\"# \t\n0123456789abx<", max_size=6))
        text = text[:i] + noise + text[j:]
    fast, reference = _outcome(text, True), _outcome(text, False)
    if not reference.startswith("refused:") or "\t" in text:
        assert fast == reference
    else:
        assert fast.startswith("refused:"), text


def test_aliases_merge_keys_and_duplicates_on_either_loader() -> None:
    merged = BASE.replace(
        "      - name: b1\n", "      - <<: {weight: 3, name: x}\n        name: b1\n"
    ).replace("      - name: b2\n", "      - &b2\n        name: b2\n")
    duplicated = edit(3, "  name: gw2")
    broken_alias = merged.replace("        weight: 1\n", "        weight: 1\n        <<: *nope\n")
    for text in (merged, duplicated, broken_alias, BASE.replace(" 8080", " 8080\t# tab")):
        assert _outcome(text, True) == _outcome(text, False), text


def test_ipv6_vips_and_backends_load() -> None:
    """A DSR VIP of either family, with backends of its own family."""
    text = edit(14, "        address: 2001:db8::11").replace(
        "        address: 198.18.0.12", "        address: '2001:db8::12'").replace(
        "    address: 198.18.1.10", "    address: '2001:db8:1::10'")
    cfg = parse_config(text, "t.yaml")
    assert [str(b.address) for b in cfg.pools["web"].backends] == ["2001:db8::11", "2001:db8::12"]
    assert str(cfg.vips[0].address) == "2001:db8:1::10"


@pytest.mark.parametrize(("line", "text", "field", "words"), [
    (21, "    address: 2001:db8::10", "pools.web.backends[0].address",
     "backend 'b1' is IPv4 and DSR VIP 'svc' (2001:db8::10) IPv6: DSR only rewrites MAC "
     "addresses, the backend must hold the VIP; give pool 'web' IPv6 backends"),
    (14, "        address: 2001:db8::11", "pools.web.backends[0].address",
     "backend 'b1' is IPv6 and DSR VIP 'svc' (198.18.1.10) IPv4"),
])
def test_a_dsr_vips_backends_are_of_its_family(line: int, text: str, field: str,
                                               words: str) -> None:
    """DSR rewrites only MACs: the configuration refuses a pool of the other
    family (the data planes would forward it blindly), naming the backend."""
    [first, *_] = error(edit(line, text)).splitlines()
    assert first.startswith("t.yaml:14:") and f": {field}: " in first and words in first, first
