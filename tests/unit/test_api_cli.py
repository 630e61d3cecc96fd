"""`hpclb`'s client commands against a real HTTP server: uvicorn on 127.0.0.1
serving the real FastAPI app (hpclb.faces.api.app) over a small in-test
implementation of the controller's Operations, backed by a real
ConfigDocument and parse_config (so edits, their refusals and the YAML
written are the real ones). Most commands run in-process through
``hpclb.faces.cli.main``; the entry point itself (exit 3, Ctrl-C on --watch)
runs as a subprocess. Every run checks that no token appears in its output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from hpclb.config import parse_config
from hpclb.faces import commands
from hpclb.faces.api.app import create_app
from hpclb.faces.api.auth import Tokens
from hpclb.faces.api.history import History
from hpclb.faces.cli import main as cli_main
from hpclb.faces.client import ApiClient, ApiError, ApiUnreachable

from .api_ops import DocumentOps

READ = "read-token-" + "r" * 16
WRITE = "write-token-" + "w" * 16
TOKENS = (READ, WRITE)

CONFIG = """\
# the appliance under test: the operator's comments must survive every edit
appliance:
  name: t1
  interfaces: {ingress: eth0}
  management_address: 127.0.0.1
  hash_key: 000102030405060708090a0b0c0d0e0f

pools:
  web:  # the web nodes
    backends:
      - {name: b1, address: 10.0.0.11}
      - {name: b2, address: 10.0.0.12, weight: 2}   # the bigger one
  spare:
    backends: []

vips:
  - {name: web-tcp, address: 198.18.1.10, port: 80, pool: web}
"""


class Ops(DocumentOps):
    """DocumentOps with this suite's snapshot (b2's probe failing) and alarms."""

    def reset(self, text: str) -> None:
        super().reset(text)
        self.alarms: list[dict[str, str]] = []

    def status(self, t: float | None = None, n: int = 5000) -> dict[str, Any]:
        """A snapshot; ``n`` packets so far (the VIP's, split 60/40 over b1, b2)."""
        cfg = self.cfg
        backends = [(p, b) for p, pool in cfg.pools.items() for b in pool.backends]
        ids = {b.name: i for i, (_, b) in enumerate(backends)}
        vids = {v.name: i for i, v in enumerate(cfg.vips)}
        split = {"b1": 0.6, "b2": 0.4}
        return {
            "time": time.time() if t is None else t, "revision": self.revision(),
            "dataplane": "xdp", "pushes_pending": False, "alarms": list(self.alarms),
            "ids": {"vips": vids, "backends": ids},
            "pools": {b.name: p for p, b in backends},
            "health": {b.name: {"up": b.name != "b2", "probe_up": b.name != "b2"}
                       for _, b in backends},
            "weights": {p: {b.name: float(b.weight) for b in pool.backends}
                        for p, pool in cfg.pools.items()},
            # b2's probe fails: the data plane has it down, whatever its admin state.
            "states": {b.name: "down" if b.name == "b2" else b.state.value
                       for _, b in backends},
            "pins": dict(self.pins),
            "rtt_ms": {"b1": 0.25},
            "dataplane_stats": {
                "counters": {"rx": n, "fwd_tx": n, "drop_malformed": 3},
                "vips": [[i, n, 100 * n] for i in vids.values()],
                "backends": [[i, int(n * split.get(name, 0)), 100 * n]
                             for name, i in ids.items()]},
            "dataplane_info": {"kind": "xdp", "reason": "configured", "attach_mode": "native",
                               "pid": 42, "capabilities": ["nat"]},
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Ops, str]]:
    """The real app on a real socket, shared by the module's tests."""
    ops = Ops(CONFIG)
    history = History()
    # Two snapshots one second apart, 1000 packets between them: the rates
    # `stats` shows come from this sample.
    history.add(ops.status(t=1000.0, n=5000))
    history.add(ops.status(t=1001.0, n=6000))
    app = create_app(ops, Tokens(read=(READ.encode(),), write=(WRITE.encode(),)),  # type: ignore[arg-type]
                     65536, history)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield ops, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def api(served: tuple[Ops, str], monkeypatch: pytest.MonkeyPatch) -> tuple[Ops, str]:
    """The server with the configuration as it was; the CLI pointed at it
    through the environment, with the write token."""
    ops, url = served
    ops.reset(CONFIG)
    monkeypatch.setenv("HPCLB_API", url)
    monkeypatch.setenv("HPCLB_API_TOKEN", WRITE)
    monkeypatch.setenv("COLUMNS", "200")  # rich: wide tables, no wrapped cells
    return ops, url


Run = tuple[int, str, str]


@pytest.fixture
def hpclb(api: tuple[Ops, str], capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*argv: str) -> Run:
        try:
            rc = cli_main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            rc = int(exc.code or 0)
        out, err = capsys.readouterr()
        for token in TOKENS:
            assert token not in out and token not in err, "a token was printed"
        return rc, out, err
    return run


def rows(out: str) -> dict[str, list[str]]:
    """A rich table's rows by their first cell."""
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) > 1 and cells[0]:
            found[cells[0]] = cells
    return found


# --- round trips --------------------------------------------------------------------------


def test_vip_list_show_set_delete_round_trip(hpclb: Callable[..., Run],
                                             api: tuple[Ops, str]) -> None:
    ops, _ = api
    rc, out, _ = hpclb("vip", "list")
    assert rc == 0 and rows(out)["web-tcp"][1] == "198.18.1.10:80/tcp", out
    assert rows(out)["web-tcp"][4] == "5,000"  # packets, by the snapshot's id map

    rc, out, err = hpclb("vip", "set", "api-v", "address=198.18.1.20", "port=8080",
                         "pool=web")
    assert rc == 0, err
    assert "VIP api-v written (revision " + ops.revision() + ")" in out
    assert "- {name: api-v, address: 198.18.1.20, port: 8080, pool: web}" in ops.text
    # key=value changes the fields given and keeps the others.
    rc, _, err = hpclb("vip", "set", "api-v", "port=81")
    assert rc == 0, err
    rc, out, _ = hpclb("--verbose", "vip", "show", "api-v", "--json")
    vip = json.loads(out)
    assert (vip["address"], vip["port"], vip["pool"]) == ("198.18.1.20", 81, "web")
    rc, out, _ = hpclb("vip", "show", "api-v")
    assert "198.18.1.20:81/tcp" in out and "pool" in out

    rc, out, err = hpclb("vip", "delete", "api-v")
    assert rc == 0 and "VIP api-v deleted" in out, err
    assert ops.text == CONFIG, "set then delete gives the operator's text back"
    assert "api-v" not in hpclb("vip", "list")[1]


def test_pool_and_backend_round_trip(hpclb: Callable[..., Run], api: tuple[Ops, str],
                                     tmp_path: Path) -> None:
    ops, _ = api
    assert hpclb("pool", "set", "batch", "weights=static")[0] == 0
    rc, _, err = hpclb("backend", "set", "b9", "address=10.0.0.19", "weight=3")
    assert rc == 2 and "--pool" in err, "a new backend needs its pool"
    rc, out, err = hpclb("backend", "set", "b9", "--pool", "batch", "address=10.0.0.19",
                         "weight=3")
    assert rc == 0 and "backend b9 written in pool batch" in out, err
    assert hpclb("backend", "set", "b9", "weight=5")[0] == 0  # its pool looked up
    b9 = json.loads(hpclb("backend", "show", "b9", "--json")[1])
    assert (b9["pool"], b9["address"], b9["weight"]["configured"]) == ("batch", "10.0.0.19", 5)
    listed = rows(hpclb("backend", "list", "--pool", "batch")[1])
    assert set(listed) - {"name"} == {"b9"} and listed["b9"][2] == "10.0.0.19"
    pool = json.loads(hpclb("pool", "show", "batch", "--json")[1])
    assert pool["backends"] == ["b9"] and pool["weights"] == "static"
    # A pool's settings change without touching its members.
    assert hpclb("pool", "set", "batch", "backend_port=8080", "probe.kind=tcp",
                 "probe.port=8080")[0] == 0
    pool = json.loads(hpclb("pool", "show", "batch", "--json")[1])
    assert pool["backends"] == ["b9"] and pool["config"]["backend_port"] == 8080
    assert pool["config"]["probe"]["kind"] == "tcp"
    # --file gives all of an object's fields.
    body = tmp_path / "b.yaml"
    body.write_text("address: 10.0.0.29  # moved\n")
    assert hpclb("backend", "set", "b9", "--file", str(body))[0] == 0
    b9 = json.loads(hpclb("backend", "show", "b9", "--json")[1])
    assert (b9["address"], b9["weight"]["configured"]) == ("10.0.0.29", 1), "weight: default"

    rc, _, err = hpclb("pool", "delete", "web")
    assert rc == 1 and "conflict" in err and "web-tcp" in err, err
    assert hpclb("backend", "delete", "b9")[0] == 0
    assert hpclb("pool", "delete", "batch")[0] == 0
    # The same configuration, the operator's comments kept. (Byte for byte is
    # ConfigDocument's business: test_config_document.py.)
    assert ops.cfg == parse_config(CONFIG, "t.yaml")
    assert "# the web nodes" in ops.text and "# the bigger one" in ops.text


def test_drain_undrain_down_up(hpclb: Callable[..., Run], api: tuple[Ops, str]) -> None:
    ops, _ = api
    rc, out, err = hpclb("drain", "b1")
    assert rc == 0 and "backend b1: admin state draining" in out, err
    assert "- {name: b1, address: 10.0.0.11, state: draining}" in ops.text
    assert "draining" in rows(hpclb("backend", "list")[1])["b1"][4]
    assert hpclb("undrain", "b1")[0] == 0 and ops.text == CONFIG
    assert hpclb("down", "b1")[0] == 0 and "state: down" in ops.text
    assert hpclb("up", "b1")[0] == 0 and ops.text == CONFIG
    rc, _, err = hpclb("drain", "nope")
    assert rc == 1 and "no backend 'nope'" in err


def test_weight_pin_and_unpin(hpclb: Callable[..., Run], api: tuple[Ops, str]) -> None:
    ops, _ = api
    rc, out, err = hpclb("weight", "b1", "2.5", "--for", "10m")
    assert rc == 0 and "weight pinned at 2.5 for 10m00s" in out, err
    assert ops.pins["b1"]["weight"] == 2.5
    assert ops.pins["b1"]["until"] - time.time() > 500  # 600 s asked
    pinned = json.loads(hpclb("backend", "show", "b1", "--json")[1])["weight"]["pinned"]
    assert pinned["weight"] == 2.5
    assert "2.5 for" in rows(hpclb("backend", "list")[1])["b1"][6]
    assert ops.text == CONFIG, "a pin is runtime state, not configuration"
    rc, out, _ = hpclb("weight", "b1", "--unpin")
    assert rc == 0 and "unpinned" in out and "b1" not in ops.pins
    for argv in (("weight", "b1", "2"), ("weight", "b1", "2", "--unpin"), ("weight", "b1"),
                 ("weight", "b1", "2", "--for", "0"), ("weight", "b1", "2", "--for", "soon")):
        assert hpclb(*argv)[0] == 2, argv
    rc, _, err = hpclb("weight", "b1", "1", "--for", "2d")
    assert rc == 1 and "duration_s" in err, "over a day: the API refuses it"


# --- output ----------------------------------------------------------------------------------


def test_json_output_is_the_apis_json(hpclb: Callable[..., Run]) -> None:
    status = json.loads(hpclb("status", "--json")[1])
    assert status["appliance"] == "t1" and status["counts"]["backends"] == 2
    assert [v["name"] for v in json.loads(hpclb("vip", "list", "--json")[1])] == ["web-tcp"]
    assert [p["name"] for p in json.loads(hpclb("pool", "list", "--json")[1])] == [
        "web", "spare"]
    backends = json.loads(hpclb("backend", "list", "--json")[1])
    assert {b["name"]: b["health"]["up"] for b in backends} == {"b1": True, "b2": False}
    assert json.loads(hpclb("diagnose", "--json")[1])["findings"]
    stats = json.loads(hpclb("stats", "--json")[1])
    assert stats["counters"]["drops"] == {"drop_malformed": 3}
    assert stats["sample"]["vips"]["web-tcp"]["pps"] == 1000.0
    assert json.loads(hpclb("config", "export", "--json")[1])["appliance"]["name"] == "t1"


def test_status_and_diagnose_are_readable(hpclb: Callable[..., Run],
                                          api: tuple[Ops, str]) -> None:
    ops, _ = api
    rc, out, _ = hpclb("status")
    assert rc == 0 and "t1" in out and ops.revision() in out
    assert "1 of 2" in out  # backends up
    assert "xdp (native), pid 42: configured" in out
    ops.alarms = [{"source": "dataplane", "message": "the data plane restarted"}]
    rc, out, _ = hpclb("diagnose")
    assert rc == 0 and "hpclb diagnose" in out
    # What the API found, each finding shown (the wording is the diagnosis's).
    findings = json.loads(hpclb("diagnose", "--json")[1])["findings"]
    assert findings and all(f["title"][:20] in out for f in findings), out


def test_config_export_prints_the_yaml_in_force_with_its_comments(
        hpclb: Callable[..., Run]) -> None:
    assert hpclb("drain", "b1")[0] == 0
    rc, out, _ = hpclb("config", "export")
    assert rc == 0
    assert out == CONFIG.replace("10.0.0.11}", "10.0.0.11, state: draining}")
    assert "# the web nodes" in out and "# the bigger one" in out


def test_stats_watch_prints_a_frame_per_interval(hpclb: Callable[..., Run]) -> None:
    rc, out, _ = hpclb("stats", "--watch", "--interval", "0.1", "--count", "2")
    assert rc == 0
    frames = out.split("VIPs")[1:]
    assert len(frames) == 2, out
    for frame in frames:
        vip = rows(frame)["web-tcp"]
        assert vip[3:] == ["1.00 k", "800.00 kb", "5,000"], vip  # pps, bit/s, packets
        b1, b2 = rows(frame)["b1"], rows(frame)["b2"]
        assert b1[2].startswith("up") and b2[2].startswith("down"), (b1, b2)
        assert (b1[4], b1[6], b1[7]) == ("1 / 1", "600", "60 %"), b1
        assert (b2[4], b2[6], b2[7]) == ("2 / 2", "400", "40 %"), b2
        assert "drops 3 (drop_malformed 3)" in frame
    lines = hpclb("stats", "--watch", "--json", "--interval", "0.1", "--count", "2")[1]
    assert [json.loads(line)["sample"]["t"] for line in lines.splitlines()] == [1001.0] * 2


# --- exit statuses and tokens ----------------------------------------------------------------


def test_api_errors_exit_1_with_message_and_problems(hpclb: Callable[..., Run],
                                                     api: tuple[Ops, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ops, _ = api
    rc, _, err = hpclb("vip", "show", "nope")
    assert rc == 1 and "no VIP 'nope'" in err and "not_found" in err and "404" in err
    rc, _, err = hpclb("vip", "set", "web-tcp", "port=99999")
    assert rc == 1 and "invalid" in err
    assert any(line.startswith("  t.yaml:") and "port" in line for line in err.splitlines()), err
    assert ops.text == CONFIG
    rc, _, err = hpclb("backend", "set", "b1", "--pool", "spare", "address=10.0.0.1")
    assert rc == 1 and "conflict" in err and "pool 'web'" in err
    monkeypatch.setenv("HPCLB_API_TOKEN", READ)
    assert hpclb("vip", "list")[0] == 0
    rc, _, err = hpclb("drain", "b1")
    assert rc == 1 and "forbidden" in err and "write token" in err
    monkeypatch.setenv("HPCLB_API_TOKEN", "not-a-token-of-this-appliance")
    rc, _, err = hpclb("status")
    assert rc == 1 and "unauthorized" in err and "--token-file" in err
    assert "not-a-token-of-this-appliance" not in err
    monkeypatch.delenv("HPCLB_API_TOKEN")
    rc, _, err = hpclb("status")
    assert rc == 1 and "unauthorized" in err
    assert ops.text == CONFIG


def test_usage_errors_exit_2(hpclb: Callable[..., Run], tmp_path: Path) -> None:
    rc, _, err = hpclb("vip", "set", "web-tcp", "port")
    assert rc == 2 and "key=value" in err
    assert hpclb("vip", "set", "web-tcp")[0] == 2  # nothing to set
    assert hpclb("vip", "frobnicate")[0] == 2
    assert hpclb("stats", "--watch", "--interval", "0")[0] == 2
    rc, _, err = hpclb("stats", "--watch", "--socket", "ipc:///nowhere")
    assert rc == 2 and "--watch" in err
    rc, _, err = hpclb("status", "--token-file", str(tmp_path / "absent"))
    assert rc == 2 and "absent" in err
    bad = tmp_path / "list.yaml"
    bad.write_text("[1, 2]\n")
    rc, _, err = hpclb("vip", "set", "web-tcp", "--file", str(bad))
    assert rc == 2 and "mapping" in err


def test_the_token_from_a_file_or_the_environment(hpclb: Callable[..., Run],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"# the operator's write token\n{WRITE}\n")
    monkeypatch.setenv("HPCLB_API_TOKEN", READ)
    rc, _, err = hpclb("drain", "b1", "--token-file", str(token_file))
    assert rc == 0, "the file's token wins over the environment's: " + err
    monkeypatch.setenv("HPCLB_API_TOKEN", WRITE)
    assert hpclb("undrain", "b1")[0] == 0
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    rc, _, err = hpclb("status", "--token-file", str(empty))
    assert rc == 2 and "holds no token" in err


def _entry(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpclb.main", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "COLUMNS": "200", **env})


def test_nothing_listening_exits_3_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    proc = _entry("backend", "list", "--api", url, env={"HPCLB_API_TOKEN": WRITE})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert f"cannot reach the API at {url}" in err and "appliance.api.listen" in err
    assert "Traceback" not in err and WRITE not in out + err


def test_ctrl_c_ends_stats_watch_cleanly(api: tuple[Ops, str]) -> None:
    _, url = api
    proc = _entry("stats", "--watch", "--interval", "0.2",
                  env={"HPCLB_API": url, "HPCLB_API_TOKEN": READ})
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the first frame is out: the watch is running
            if "web-tcp" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


# --- the client ------------------------------------------------------------------------------


def test_a_write_right_after_a_read_sends_its_revision(api: tuple[Ops, str]) -> None:
    """Read-modify-write: the write is refused (412) when the configuration
    changed after the read; a write without a read applies to what is current."""
    ops, url = api
    with ApiClient(url, WRITE) as client:
        assert "ApiClient" in repr(client) and WRITE not in repr(client)
        client.get("/vips/web-tcp")
        assert client.read_etag == ops.revision()
        ops.change(lambda d: d.set_backend_state("b2", "draining"))  # someone else
        with pytest.raises(ApiError) as stale:
            client.put("/vips/web-tcp", {"address": "198.18.1.10", "port": 81, "pool": "web"})
        assert (stale.value.status, stale.value.kind) == (412, "precondition_failed")
        assert "port: 81" not in ops.text
        assert client.read_etag is None, "one write per read"
        answer = client.put("/vips/web-tcp", {"address": "198.18.1.10", "port": 81,
                                              "pool": "web"})
        assert answer["revision"] == ops.revision() == client.revision
    with pytest.raises(ApiUnreachable) as down:
        ApiClient(f"http://127.0.0.1:{_free_port()}", WRITE).get("/status")
    assert WRITE not in str(down.value)


# --- renderers (pure) ------------------------------------------------------------------------


def test_assignments_are_yaml_scalars_and_null_removes_a_field() -> None:
    parsed = commands.parse_assignments(["port=81", "snat=true", "mac=10:20:30:40:50:60",
                                         "probe.kind=http", "weight=null", "name=web 2"])
    body = commands.apply_assignments({"weight": 3, "probe": {"port": 80}}, parsed)
    assert body == {"port": 81, "snat": True, "mac": "10:20:30:40:50:60",
                    "probe": {"port": 80, "kind": "http"}, "name": "web 2"}
    for bad in ("port", "=1", "a..b=1"):
        with pytest.raises(commands.UsageError):
            commands.parse_assignments([bad])


def test_error_lines_give_the_problems_and_what_to_do() -> None:
    lines = commands.error_lines(ApiError(412, "precondition_failed", "changed", ["a", "b"]),
                                 "http://x")
    assert lines[0] == "hpclb: changed (precondition_failed, HTTP 412)"
    assert lines[1:3] == ["  a", "  b"] and "run it again" in lines[3]
    assert "hpclb API" in commands.error_lines(ApiError(502, "http_502", "Bad Gateway"),
                                               "http://x")[-1]
