"""Lab: the REST API of a running appliance (`hpclb run` with appliance.api,
the XDP data plane in the lab's appliance namespace).

Reads must reflect what the appliance does, writes must change what the data
plane holds and the configuration file (its comments kept), refused writes
must change nothing anywhere, concurrent writes must serialise, and a kill -9
in a burst of writes must lose no acknowledged write and leave none half
applied. Requests are made from inside the appliance's namespace, where the
management address is.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from hpclb.contract.tables import BackendState
from hpclb.host.netns import inside
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

from .polling import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP)")

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
COMMENT = "# operator's note: kept across API writes\n"
STATE_NAMES = {"up": BackendState.UP, "draining": BackendState.DRAINING,
               "down": BackendState.DOWN}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"a{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


@pytest.fixture(scope="module")
def appliance(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    with LabAppliance(lab, tmp_path_factory.mktemp("api"), WEIGHTS, dataplane="xdp",
                      api=True) as app:
        # The operator's comment, loaded by a reload: every write must keep it.
        app.config_path.write_text(COMMENT + app.config_path.read_text())
        assert app.proc is not None
        app.proc.send_signal(signal.SIGHUP)
        wait_for("the reloaded file", lambda: app.api(
            "GET", "/api/v1/config?format=yaml", app.read_token).text.startswith(COMMENT))
        yield app


def get(app: LabAppliance, path: str) -> Any:
    r = app.api("GET", path, app.read_token)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def file_config(app: LabAppliance) -> dict[str, Any]:
    text = app.config_path.read_text()
    assert text.startswith(COMMENT), text[:200]
    return dict(yaml.safe_load(text))


def dataplane_view(app: LabAppliance) -> dict[str, Any]:
    """What the data plane holds: backends by id with their state, VIPs by
    (port, proto), each VIP's ring as slot counts per backend id."""
    dump = app.client.dump()
    return {
        "backends": {int(b["id"]): int(b["state"]) for b in dump["backends"]},
        "vips": {(int(v["port"]), int(v["proto"])): int(v["vip_id"]) for v in dump["vips"]},
        "rings": {int(v["vip_id"]): Counter(int(s) for s in app.client.get_ring(v["vip_id"])
                                            if s != 0xFFFFFFFF)
                  for v in dump["vips"]},
    }


def backend_ids(app: LabAppliance) -> dict[str, int]:
    return {b["name"]: b["id"] for b in get(app, "/api/v1/backends")}


def test_reads_reflect_the_appliance(lab: Lab, appliance: LabAppliance) -> None:
    status = get(appliance, "/api/v1/status")
    assert status["dataplane"]["kind"] == "xdp"
    assert status["counts"]["backends"] == 3
    backends = {b["name"]: b for b in wait_for("backends up", lambda: [
        b for b in get(appliance, "/api/v1/backends") if b["state"] == "up"]
        if len(get(appliance, "/api/v1/backends")) == 3 else None)}
    assert set(backends) == set(WEIGHTS)
    assert backends["b3"]["weight"]["configured"] == 2.0
    dp = dataplane_view(appliance)
    assert {b["id"] for b in backends.values()} == set(dp["backends"])
    before = get(appliance, "/api/v1/counters")["vips"].get("lab-tcp", {"packets": 0})
    assert lab.run_client(LAB_VIP, LAB_PORT, connections=30)["failures"] == 0
    after = wait_for("the VIP's counters to move", lambda: (
        c := get(appliance, "/api/v1/counters")["vips"].get("lab-tcp"))
        and c["packets"] >= before["packets"] + 90 and c)
    assert after["bytes"] > 0
    forwarded = get(appliance, "/api/v1/counters")["backends"]
    assert sum(c["packets"] for c in forwarded.values()) >= 90
    hist = wait_for("a history", lambda: (h := get(appliance, "/api/v1/history?seconds=60"))
                    and len(h["t"]) >= 2 and h)
    assert set(hist["backends"]) >= set(WEIGHTS)


def test_writes_change_the_data_plane_and_the_file(appliance: LabAppliance) -> None:
    ids = backend_ids(appliance)
    vip_id = dataplane_view(appliance)["vips"][(LAB_PORT, 6)]

    r = appliance.api("POST", "/api/v1/backends/b1/drain")
    assert r.status_code == 200, r.text
    assert r.json()["revision"] == r.headers["etag"].strip('"')
    dp = dataplane_view(appliance)
    assert dp["backends"][ids["b1"]] == BackendState.DRAINING
    assert ids["b1"] not in dp["rings"][vip_id]
    pool = file_config(appliance)["pools"]["lab"]["backends"]
    assert next(b for b in pool if b["name"] == "b1")["state"] == "draining"
    assert appliance.api("POST", "/api/v1/backends/b1/undrain").status_code == 200
    dp = dataplane_view(appliance)
    assert dp["backends"][ids["b1"]] == BackendState.UP and ids["b1"] in dp["rings"][vip_id]

    revision = get(appliance, "/api/v1/status")["revision"]
    r = appliance.api("PUT", "/api/v1/backends/b2/pin", json={"weight": 0, "duration_s": 120})
    assert r.status_code == 200, r.text
    assert r.json()["backend"]["weight"]["pinned"]["weight"] == 0.0
    assert ids["b2"] not in dataplane_view(appliance)["rings"][vip_id]
    assert get(appliance, "/api/v1/status")["revision"] == revision  # runtime, not config
    assert appliance.api("DELETE", "/api/v1/backends/b2/pin").status_code == 200
    assert ids["b2"] in dataplane_view(appliance)["rings"][vip_id]

    address = str(ipaddress.ip_address(appliance.lab.ip_of("b1")) + 100)
    r = appliance.api("PUT", "/api/v1/pools/lab/backends/b9",
                      json={"address": address, "mac": "02:00:00:00:00:99"})
    assert r.status_code == 200, r.text
    assert r.json()["backend"]["address"] == address
    # Its id shows once the status snapshot (refreshed every second) has it.
    b9_id = wait_for("b9's id", lambda: backend_ids(appliance).get("b9"))
    assert b9_id in dataplane_view(appliance)["backends"]
    assert "b9" in [b["name"] for b in file_config(appliance)["pools"]["lab"]["backends"]]
    assert appliance.api("DELETE", "/api/v1/pools/lab/backends/b9").status_code == 200
    assert b9_id not in dataplane_view(appliance)["backends"]

    r = appliance.api("PUT", "/api/v1/vips/extra",
                      json={"address": LAB_VIP, "port": 9090, "protocol": "tcp", "pool": "lab"})
    assert r.status_code == 200, r.text
    assert (9090, 6) in dataplane_view(appliance)["vips"]
    assert "extra" in [v["name"] for v in file_config(appliance)["vips"]]
    assert appliance.api("DELETE", "/api/v1/vips/extra").status_code == 200
    assert (9090, 6) not in dataplane_view(appliance)["vips"]
    assert "extra" not in [v["name"] for v in file_config(appliance)["vips"]]


@pytest.mark.parametrize("body", [
    {"address": LAB_VIP, "port": 9091, "protocol": "tcp", "pool": "nope"},
    {"address": LAB_VIP, "port": LAB_PORT, "protocol": "tcp", "pool": "lab"},  # duplicate
    {"address": LAB_VIP, "port": 0, "protocol": "tcp", "pool": "lab"},
])
def test_an_invalid_write_changes_nothing(appliance: LabAppliance, body: dict[str, Any]) -> None:
    text = appliance.config_path.read_text()
    revision = get(appliance, "/api/v1/status")["revision"]
    dp = dataplane_view(appliance)
    r = appliance.api("PUT", "/api/v1/vips/bad", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid" and r.json()["message"]
    assert appliance.config_path.read_text() == text
    assert get(appliance, "/api/v1/status")["revision"] == revision
    assert dataplane_view(appliance) == dp


def test_concurrent_conflicting_writes_serialise(appliance: LabAppliance) -> None:
    """50 writers of b1's weight, half with If-Match of the same revision: the
    result is one serial order of the accepted writes, every refused one got
    412, and the data plane holds what the API reports."""
    start = get(appliance, "/api/v1/status")["revision"]
    results: dict[int, httpx.Response] = {}
    go = threading.Barrier(50)

    def write(i: int) -> None:
        headers = {"If-Match": f'"{start}"'} if i % 2 == 0 else {}
        body = {"address": appliance.lab.ip_of("b1"), "weight": 1.0 + (i + 1) / 100}
        go.wait()
        results[i] = appliance.api("PUT", "/api/v1/pools/lab/backends/b1", json=body,
                                   headers=headers)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = Counter(r.status_code for r in results.values())
    assert set(statuses) <= {200, 412}, statuses
    accepted = {i: r.json()["revision"] for i, r in results.items() if r.status_code == 200}
    refused = [i for i, r in results.items() if r.status_code == 412]
    print(f"50 concurrent writes: {len(accepted)} accepted, {len(refused)} refused (412)")
    assert all(i % 2 == 0 for i in refused)  # only a conditional write can be stale
    assert sum(1 for i in accepted if i % 2 == 0) <= 1  # one If-Match of `start` wins at most
    assert len(set(accepted.values())) == len(accepted)  # each a new text: a serial chain
    final = get(appliance, "/api/v1/status")["revision"]
    last = [i for i, rev in accepted.items() if rev == final]
    assert len(last) == 1, (final, accepted)
    weight = 1.0 + (last[0] + 1) / 100
    b1 = next(b for b in file_config(appliance)["pools"]["lab"]["backends"] if b["name"] == "b1")
    assert b1["weight"] == weight

    # The data plane's ring against the weights the API reports, once pushed.
    def settled() -> list[dict[str, Any]] | None:
        backends = get(appliance, "/api/v1/backends")
        b1 = next(b for b in backends if b["name"] == "b1")
        return backends if b1["weight"]["live"] == weight else None

    backends = wait_for("the live weight", settled)
    dp = dataplane_view(appliance)
    for b in backends:
        assert dp["backends"][b["id"]] == STATE_NAMES[b["state"]], b
    ring = dp["rings"][dp["vips"][(LAB_PORT, 6)]]
    total = sum(b["weight"]["live"] for b in backends)
    for b in backends:
        share = ring[b["id"]] / sum(ring.values())
        assert share == pytest.approx(b["weight"]["live"] / total, abs=0.02), (b, share)


def test_schemathesis_against_the_live_server(appliance: LabAppliance) -> None:
    """The served OpenAPI document against the live server: reads, and the
    backend state writes; no 5xx, every answer as documented."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    with inside(appliance.lab.lb_ns):
        schema = schemathesis.openapi.from_url(f"{appliance.api_url}/openapi.json")
    schema.config.phases.coverage.enabled = False
    ops = [op.ok() for op in schema.get_all_operations()]
    chosen = [op for op in ops if op.path != "/api/v1/events" and (
        op.method == "get" or op.path.startswith("/api/v1/backends/{name}/"))]
    assert len(chosen) >= 15
    auth = {"Authorization": f"Bearer {appliance.write_token}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    for op in chosen:
        @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(op.as_strategy())
        def check(case: schemathesis.Case) -> None:
            with inside(appliance.lab.lb_ns):
                response = case.call(base_url=appliance.api_url, headers=auth)
            case.validate_response(response, checks=checks)

        check()
    # Known names too: the generated ones are mostly unknown (404).
    for path in ("/api/v1/backends/b2/drain", "/api/v1/backends/b2/undrain"):
        assert appliance.api("POST", path).status_code == 200


def test_kill_9_in_a_burst_of_writes_loses_no_acknowledged_write(
        appliance: LabAppliance) -> None:
    base = ipaddress.ip_address(appliance.lab.ip_of("b1")) + 110
    acked: list[str] = []
    lock = threading.Lock()

    def write(k: int) -> None:
        name = f"k{k}"
        try:
            r = appliance.api("PUT", f"/api/v1/pools/lab/backends/{name}", timeout_s=10,
                              json={"address": str(base + k), "mac": f"02:00:00:00:01:{k:02x}"})
        except httpx.HTTPError:
            return  # cut off by the kill: not acknowledged
        if r.status_code == 200:
            with lock:
                acked.append(name)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    wait_for("a few acknowledged writes", lambda: len(acked) >= 3, timeout_s=60)
    appliance.kill()
    for t in threads:
        t.join(30)
    acked_now = set(acked)
    print(f"kill -9 after {len(acked_now)} of 24 writes were acknowledged")
    assert len(acked_now) < 24, "the kill came after the burst: nothing was tested"
    in_file = {b["name"] for b in file_config(appliance)["pools"]["lab"]["backends"]}
    assert acked_now <= in_file
    appliance.resume()
    api_names = set(wait_for("the API after the restart", lambda: backend_ids(appliance)))
    assert api_names == in_file  # what is in force is what is in the file
    ids = backend_ids(appliance)
    dp = wait_for("the data plane to hold the file's backends", lambda: (
        d := dataplane_view(appliance)) and set(d["backends"]) == set(ids.values()) and d)
    assert set(dp["backends"]) == {ids[n] for n in in_file}


def test_the_api_needs_a_token_on_the_live_server(appliance: LabAppliance) -> None:
    assert appliance.api("GET", "/api/v1/status", token=None).status_code == 401
    assert appliance.api("POST", "/api/v1/backends/b1/drain",
                         token=appliance.read_token).status_code == 403
    assert appliance.api("GET", "/openapi.json", token=None).status_code == 200
    assert appliance.api("GET", "/", token=None).status_code == 200  # the status page
    assert appliance.read_token not in appliance.log_text_full()
    assert appliance.write_token not in appliance.log_text_full()


