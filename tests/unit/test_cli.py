"""The `hpclb` command: configuration errors exit 2 and name file, line, field."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "appliance" / "examples"


def hpclb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpclb.faces.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_check_accepts_the_examples() -> None:
    for example in sorted(EXAMPLES.glob("*.yaml")):
        res = hpclb("check", "--schema-only", "-c", str(example))
        assert res.returncode == 0, res.stderr
        assert "schema ok" in res.stdout


HOST_CONFIG = """\
appliance:
  name: t
  interfaces: {ingress: lo}
  hash_key: 000102030405060708090a0b0c0d0e0f
  management_address: MGMT
  metrics: ":19108"
telemetry:
  server_key: KEYS/server.key_secret
  allow_dir: KEYS/agents
pools:
  p: {backends: [{name: n1, address: 127.0.0.2}]}
vips: [{name: v, address: 198.18.1.10, port: 80, pool: p}]
"""


def test_check_names_missing_key_files_and_foreign_addresses(tmp_path: Path) -> None:
    """`hpclb check` (and so `hpclb run` before it touches anything) checks what
    the host must give: key files that hold keys, addresses that are this host's."""
    config = tmp_path / "host.yaml"
    config.write_text(HOST_CONFIG.replace("KEYS", str(tmp_path / "curve"))
                      .replace("MGMT", "192.0.2.77"))
    res = hpclb("check", "-c", str(config))
    assert res.returncode == 2, res.stdout
    assert "telemetry.server_key" in res.stderr and "server.key_secret" in res.stderr
    assert "telemetry.allow_dir" in res.stderr and "does not exist" in res.stderr
    assert "192.0.2.77 is not an address of this host" in res.stderr
    assert "appliance.management_address" in res.stderr and "telemetry.bind" in res.stderr
    assert "Traceback" not in res.stderr
    assert hpclb("check", "--schema-only", "-c", str(config)).returncode == 0

    keys = tmp_path / "curve"
    subprocess.run([sys.executable, "-m", "hpclb.agent.main", "keygen", str(keys),
                    "--name", "server"], check=True, capture_output=True, timeout=60)
    (keys / "agents").mkdir()
    config.write_text(HOST_CONFIG.replace("KEYS", str(keys)).replace("MGMT", "127.0.0.1"))
    res = hpclb("check", "-c", str(config))
    assert res.returncode == 0, res.stderr
    (keys / "agents" / "n1.key").write_text("not a certificate\n")
    res = hpclb("check", "-c", str(config))
    assert res.returncode == 2 and "n1.key" in res.stderr, res.stderr


def test_broken_config_exits_2_naming_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (EXAMPLES / "lab.yaml").read_text().replace("port: 8080", "port: 80800", 1)
    bad.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "80800" in row)
    for command in ("check", "run"):
        res = hpclb(command, "-c", str(bad), *(["--run-dir", str(tmp_path)] * (command == "run")))
        assert res.returncode == 2
        assert f"bad.yaml:{line}:" in res.stderr and "vips[0].port" in res.stderr
        assert "Traceback" not in res.stderr
    assert not list(tmp_path.glob("*.pid")), "nothing started half-configured"


def test_yaml_syntax_error_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "syntax.yaml"
    bad.write_text("appliance:\n  name: [unclosed\n")
    res = hpclb("check", "-c", str(bad))
    assert res.returncode == 2 and "syntax.yaml:" in res.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    res = hpclb("check", "-c", str(tmp_path / "absent.yaml"))
    assert res.returncode == 2 and "absent.yaml" in res.stderr


def test_status_prints_the_status_file_or_says_why_not(tmp_path: Path) -> None:
    example = str(EXAMPLES / "lab.yaml")
    res = hpclb("status", "-c", example, "--run-dir", str(tmp_path))
    assert res.returncode == 1 and "no status" in res.stderr
    (tmp_path / "lab-lb.status.json").write_text('{"health": {}}\n')
    res = hpclb("status", "-c", example, "--run-dir", str(tmp_path))
    assert res.returncode == 0 and res.stdout == '{"health": {}}\n'


EMPTY_POOL_CONFIG = """\
appliance:
  name: t
  interfaces: {ingress: lo}
  hash_key: 000102030405060708090a0b0c0d0e0f
pools:
  web: {backends: [{name: n1, address: 127.0.0.2}]}
  gpu: {backends: []}
  spare: {}
vips:
  - {name: www, address: 198.18.1.10, port: 80, pool: web}
  - {name: infer, address: 198.18.1.11, port: 8000, pool: gpu}
  - {name: infer-udp, address: 198.18.1.11, port: 8000, protocol: udp, pool: gpu}
"""


def test_check_warns_of_a_vip_whose_pool_is_empty(tmp_path: Path) -> None:
    """Valid (nodes may come later), but such a VIP drops everything: a warning
    on stderr naming the VIP and its pool, and still exit status 0. A pool no
    VIP uses is not worth one."""
    config = tmp_path / "empty.yaml"
    config.write_text(EMPTY_POOL_CONFIG)
    for extra in (["--schema-only"], []):
        res = hpclb("check", *extra, "-c", str(config))
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"{config}: "), res.stdout
        warnings = res.stderr.splitlines()
        assert warnings == [
            f"{config}: warning: VIP 'infer' (198.18.1.11:8000/tcp): pool 'gpu' has no "
            "backend; its traffic is dropped until one is added",
            f"{config}: warning: VIP 'infer-udp' (198.18.1.11:8000/udp): pool 'gpu' has no "
            "backend; its traffic is dropped until one is added",
        ], res.stderr
    config.write_text(EMPTY_POOL_CONFIG.replace("pool: gpu}", "pool: web}"))
    res = hpclb("check", "--schema-only", "-c", str(config))
    assert res.returncode == 0 and res.stderr == "", res.stderr


def test_run_logs_the_empty_pool_warning_at_start_and_reload(
        caplog: pytest.LogCaptureFixture) -> None:
    """`hpclb run` logs the same lines wherever it puts a configuration in force
    (start and reload both commit through Controller._commit, which calls
    warn_empty_pools next to warn_small_rings, once each)."""
    import inspect

    from hpclb.config import parse_config
    from hpclb.controller import core as controller

    with caplog.at_level(logging.WARNING, logger="hpclb.controller"):
        controller.warn_empty_pools(parse_config(EMPTY_POOL_CONFIG))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2 and all("pool 'gpu' has no backend" in line for line in lines)
    assert "VIP 'infer' " in lines[0] and "VIP 'infer-udp' " in lines[1]
    source = inspect.getsource(controller.Controller)
    assert source.count("warn_empty_pools(") == source.count("warn_small_rings(") == 1
    commit = inspect.getsource(controller.Controller._commit)
    assert "warn_empty_pools(config)" in commit and "warn_small_rings(config)" in commit
    for entry in (controller.Controller.start, controller.Controller.reload):
        assert "self._commit(prepared)" in inspect.getsource(entry)


def test_the_installed_commands_name_modules_that_exist() -> None:
    """What pyproject.toml installs as `hpclb` and `hpclb-agent` imports, and
    `hpclb` offers the appliance's commands and the lab's."""
    import importlib
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert set(scripts) == {"hpclb", "hpclb-agent"}
    for target in scripts.values():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
    out = subprocess.run([sys.executable, "-m", "hpclb.main", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for command in ("check", "run", "stats", "status", "demo", "bench"):
        assert command in out, (command, out)


STATS = {
    "counters": {"rx": 100, "fwd_tx": 90, "pass_not_vip": 10, "conn_new": 7, "conn_evict": 3},
    "vips": [[0, 90, 5400]],
    "backends": [[0, 60, 3600], [1, 30, 1800]],
}
CONNS = {"capacity": 1024, "entries": 256,
         "by_state": {"syn_sent": 3, "established": 120, "udp_replied": 5},
         "snat_ports_in_use": 12, "expired": 4567}


def test_stats_are_tables_with_the_connection_table_when_reported() -> None:
    """`hpclb stats` prints the data plane's reply as tables; the NAT connection
    table (fill, states, evictions from conn_evict, SNAT ports, expiries) only
    from a data plane that reports one."""
    from hpclb.faces.cli import build_parser, render_stats

    plain = render_stats(STATS)
    lines = plain.splitlines()
    assert lines[0] == "counters" and lines[1].split() == ["rx", "100"]
    assert ["0", "60", "3600"] in [line.split() for line in lines]
    assert "connection table" not in plain

    text = render_stats({**STATS, "conns": CONNS})
    section = text.split("connection table (NAT)\n")[1].splitlines()
    rows = {line.split()[0]: line.split() for line in section}
    assert rows["capacity"][:2] == ["capacity", "1024"]
    assert rows["entries"][:3] == ["entries", "256", "25.0"]  # % full
    assert rows["connections"] == ["connections", "128"]
    assert rows["established"] == ["established", "120"] and section[3].startswith("    ")
    assert rows["evictions"][:2] == ["evictions", "3"]  # the conn_evict counter
    assert rows["SNAT"][:5] == ["SNAT", "ports", "in", "use", "12"]
    assert rows["expired"][:2] == ["expired", "4567"]
    empty = render_stats({"counters": {}, "conns": {"capacity": 0, "entries": 0,
                                                   "by_state": {}}})
    assert "no table" in empty and "Traceback" not in empty
    assert build_parser().parse_args(["stats", "--json"]).json is True


def test_stats_and_status_ask_the_api_unless_given_their_local_options(tmp_path: Path) -> None:
    """`stats --socket S` asks the data plane and `status -c CONFIG` reads the
    status file, as before; without those options both go over the REST API
    (there was a default socket: `hpclb stats` alone now asks the API)."""
    from hpclb.faces.cli import build_parser

    assert build_parser().parse_args(["stats"]).socket is None
    assert build_parser().parse_args(["status"]).config is None
    nowhere = "http://127.0.0.1:9"  # discard: nothing answers
    for argv in (["stats"], ["status"]):
        res = hpclb(*argv, "--api", nowhere)
        assert res.returncode == 3 and f"cannot reach the API at {nowhere}" in res.stderr
    res = hpclb("status", "-c", str(EXAMPLES / "lab.yaml"), "--run-dir", str(tmp_path),
                "--api", nowhere)
    assert res.returncode == 1 and "no status" in res.stderr, "-c: the file, not the API"
    res = hpclb("stats", "--socket", "ipc:///nowhere", "--watch")
    assert res.returncode == 2 and "--watch" in res.stderr


CA_CONFIG = """\
appliance:
  name: t
  interfaces: {ingress: lo}
  hash_key: 000102030405060708090a0b0c0d0e0f
pools:
  missing:
    probe: {kind: https, ca_file: DIR/absent.pem}
    backends: [{name: n1, address: 127.0.0.2}]
  garbage:
    probe: {kind: https, ca_file: DIR/garbage.pem}
    backends: [{name: n2, address: 127.0.0.3}]
  good:
    probe: {kind: https, ca_file: DIR/server.pem}
    backends: [{name: n3, address: 127.0.0.4}]
  system: {probe: {kind: https}, backends: [{name: n4, address: 127.0.0.5}]}
vips:
  - {name: a, address: 198.18.1.10, port: 443, pool: missing}
  - {name: b, address: 198.18.1.11, port: 443, pool: garbage}
  - {name: c, address: 198.18.1.12, port: 443, pool: good}
  - {name: d, address: 198.18.1.13, port: 443, pool: system}
"""


def test_check_refuses_an_https_probe_ca_file_it_cannot_use(tmp_path: Path) -> None:
    """The CA file of an https probe is read at `hpclb check` (and so at a
    reload), not first when a backend is probed: a missing file and one that
    holds no certificate are each named by their pool; a good one passes."""
    from tests.unit.test_health_tls import _make_cert

    _make_cert(tmp_path)
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    config = tmp_path / "ca.yaml"
    config.write_text(CA_CONFIG.replace("DIR", str(tmp_path)))
    assert hpclb("check", "--schema-only", "-c", str(config)).returncode == 0
    res = hpclb("check", "-c", str(config))
    assert res.returncode == 2, res.stdout
    lines = [line for line in res.stderr.splitlines() if "probe.ca_file" in line]
    assert len(lines) == 2, res.stderr
    assert "pools.missing.probe.ca_file:" in lines[0] and "absent.pem" in lines[0]
    assert "pools.garbage.probe.ca_file:" in lines[1] and "garbage.pem" in lines[1]
    assert "Traceback" not in res.stderr
    config.write_text(CA_CONFIG.replace("DIR", str(tmp_path)).replace("absent.pem", "server.pem")
                      .replace("garbage.pem", "server.pem"))
    res = hpclb("check", "-c", str(config))
    assert res.returncode == 0, res.stderr


def test_a_bare_status_on_a_provisioned_appliance_without_api_reads_its_status_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`hpclb status` with no option on a host provisioned with a configuration
    that enables no REST API (the Vagrant gateway's): the status file of
    /etc/hpclb/hpclb.yaml, not an API that cannot answer. With an API in the
    configuration, or --api / $HPCLB_API given, the API as before."""
    from hpclb.faces import cli

    installed = tmp_path / "hpclb.yaml"
    text = (EXAMPLES / "lab.yaml").read_text()
    assert "\n  api:" not in text
    installed.write_text(text)
    monkeypatch.setattr(cli, "INSTALLED_CONFIG", installed)
    monkeypatch.delenv("HPCLB_API", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert cli.main(["status", "--run-dir", str(run_dir)]) == 1
    assert "no status" in capsys.readouterr().err
    (run_dir / "lab-lb.status.json").write_text('{"health": {}}\n')
    assert cli.main(["status", "--run-dir", str(run_dir)]) == 0
    assert capsys.readouterr().out == '{"health": {}}\n'
    nowhere = "http://127.0.0.1:9"
    assert cli.main(["status", "--api", nowhere]) == 3, "--api: the API"
    monkeypatch.setenv("HPCLB_API", nowhere)
    assert cli.main(["status"]) == 3, "$HPCLB_API: the API"
    monkeypatch.delenv("HPCLB_API")
    installed.write_text(text.replace("appliance:\n", "appliance:\n  api: {listen: "
                                      "\"127.0.0.1:9\"}\n", 1))
    assert cli.main(["status"]) == 3, "an API configured: the API"
    assert "cannot reach the API" in capsys.readouterr().err
