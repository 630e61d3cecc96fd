"""The peers' pure parts: HAProxy's configuration, the kernel NAT ruleset's IPv6 twin
and redirect rule, the connection-rate client's arithmetic, IPVS detection. No lab."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from hpclb.lab.kernel_nat import NFT_TABLE, KernelNat, nft_family, ruleset
from hpclb.lab.peers import (
    _parse_targets,
    _targets_arg,
    haproxy_maxconn,
    ipvs_missing,
    percentiles,
    render_haproxy,
)

SERVERS = [("b1", "198.18.0.11", 8080), ("b2", "198.18.0.12", 8080),
           ("b3", "198.18.0.13", 8080)]


def test_haproxy_config_tcp_round_robin_over_every_backend() -> None:
    text = render_haproxy([("198.18.1.10", 8080)], SERVERS, threads=2, maxconn=5000)
    assert text.endswith("\n")  # haproxy refuses a last line without LF
    assert "    mode tcp\n" in text and "    balance roundrobin\n" in text
    assert "    bind 198.18.1.10:8080\n" in text
    for name, address, port in SERVERS:
        assert f"    server {name} {address}:{port}\n" in text
    assert "maxconn 5000" in text and "nbthread 2" in text
    assert "option nolinger" in text and "\nlog" not in text


def test_haproxy_config_ipv6_in_brackets() -> None:
    text = render_haproxy([("fd48:4c01::10", 8080)], [("b1", "fd48:4c00::11", 9000)])
    assert "bind [fd48:4c01::10]:8080" in text and "server b1 [fd48:4c00::11]:9000" in text


def test_haproxy_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        render_haproxy([], SERVERS)
    with pytest.raises(ValueError):
        render_haproxy([("198.18.1.10", 8080)], [])
    with pytest.raises(ValueError):
        render_haproxy([("198.18.1.10", 0)], SERVERS)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed")
def test_haproxy_accepts_the_rendered_config(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(render_haproxy([("198.18.1.10", 8080), ("fd48:4c01::10", 8080)], SERVERS,
                                  maxconn=haproxy_maxconn()))
    res = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_maxconn_fits_the_descriptor_limit() -> None:
    assert 100 <= haproxy_maxconn() <= 20000
    assert haproxy_maxconn(ceiling=300) <= 300


def test_kernel_nat_ipv6_twin() -> None:
    nat = KernelNat("fd48:4c01::10", 8080, ("fd48:4c00::11", "fd48:4c00::12"),
                    balance="jhash", drop_redirects=True)
    assert nat.family == 6 and nft_family(6) == "ip6"
    text = ruleset(nat)
    assert f"table ip6 {NFT_TABLE} {{" in text
    assert ("ip6 daddr fd48:4c01::10 meta l4proto { tcp, udp } th dport 8080 counter dnat "
            "to jhash ip6 saddr . th sport . ip6 daddr . th dport mod 2 seed ") in text
    assert "map { 0 : fd48:4c00::11, 1 : fd48:4c00::12 }" in text
    assert "type filter hook output priority filter" in text
    assert "icmpv6 type nd-redirect counter drop" in text
    ported = ruleset(KernelNat("fd48:4c01::10", 8080, ("fd48:4c00::11",), backend_port=9000))
    assert "dnat ip6 to numgen random mod 1 map { 0 : fd48:4c00::11 . 9000 }" in ported


def test_kernel_nat_ipv4_redirect_rule_and_family_checks() -> None:
    text = ruleset(KernelNat("198.18.1.10", 8080, ("198.18.0.11",), drop_redirects=True))
    assert f"table ip {NFT_TABLE} {{" in text and "icmp type redirect counter drop" in text
    assert "chain output" not in ruleset(KernelNat("198.18.1.10", 8080, ("198.18.0.11",)))
    with pytest.raises(ValueError):
        KernelNat("198.18.1.10", 8080, ("fd48:4c00::11",))  # families mixed
    with pytest.raises(ValueError):
        KernelNat("fd48:4c01::10", 8080, ("fd48:4c00::11",), snat_to="198.18.0.3")
    with pytest.raises(ValueError):
        nft_family(5)


def test_percentiles() -> None:
    p = percentiles(list(range(1, 1001)))
    assert p["min_us"] == 1 and p["max_us"] == 1000
    assert p["p50_us"] == 501 and p["p99_us"] == 991 and p["p999_us"] == 1000
    assert p["avg_us"] == pytest.approx(500.5)
    assert percentiles([]) == {}


def test_targets_round_trip() -> None:
    targets = [("198.18.0.11", 8080), ("fd48:4c00::11", 8080)]
    assert _targets_arg(targets) == "198.18.0.11:8080,[fd48:4c00::11]:8080"
    assert _parse_targets(_targets_arg(targets)) == targets


def test_ipvs_detection_gives_evidence() -> None:
    reason = ipvs_missing()
    # Where the kernel has IPVS there is nothing to say; where not, the evidence.
    if reason is not None:
        assert "has no IPVS" in reason and "/proc/net/ip_vs" in reason
