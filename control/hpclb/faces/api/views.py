"""What the API answers: the controller's status snapshot and the
configuration in force turned into the spec's Vip, Pool, Backend, counters
and status documents. Pure functions of (configuration, snapshot); the
pydantic models are the OpenAPI document's response schemas.

The snapshot may be None (none written yet) or lag a write by up to a second:
every figure it gives is then null or empty, never invented.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpclb.config import BackendConfig, HpclbConfig, PoolConfig, VipConfig

Status = Mapping[str, Any]
AdminState = Literal["up", "draining", "down"]


class Counters(BaseModel):
    packets: int
    bytes: int


class Vip(BaseModel):
    name: str
    address: str
    port: int
    protocol: str
    mode: str
    pool: str
    id: int | None = Field(description="the data plane's VIP id (null before it is pushed)")
    config: dict[str, Any] = Field(description="the VIP's YAML fields, as JSON (a PUT body)")
    counters: Counters | None


class Pool(BaseModel):
    name: str
    weights: Literal["static", "dynamic"]
    backends: list[str]
    vips: list[str]
    config: dict[str, Any] = Field(description="the pool's YAML fields, backends included")


class Health(BaseModel):
    up: bool
    probe_up: bool
    beats_missed: bool
    unknown: bool = Field(description="no verdict yet, or one held back by a local fault")
    rtt_ms: float | None
    damping: dict[str, Any] | None


class Pin(BaseModel):
    weight: float
    until: float = Field(description="unix time the pin expires")


class Weight(BaseModel):
    configured: float
    live: float = Field(description="the weight the ring is built with now")
    pinned: Pin | None
    inputs: dict[str, Any] | None = Field(description="the weight tracker's latest sample "
                                          "(dynamic pools)")


class Backend(BaseModel):
    name: str
    pool: str
    address: str
    id: int | None
    admin_state: AdminState
    state: AdminState = Field(description="the data plane's, as decided (health, MAC, admin)")
    health: Health
    weight: Weight
    telemetry: dict[str, Any] | None
    counters: Counters | None


class DataplaneInfo(BaseModel):
    kind: str
    reason: str
    attach_mode: str | None
    pid: int | None
    capabilities: list[str]


class Alarm(BaseModel):
    source: str
    message: str


class Counts(BaseModel):
    vips: int
    pools: int
    backends: int
    backends_up: int


class StatusView(BaseModel):
    appliance: str
    revision: str
    time: float
    dataplane: DataplaneInfo
    pushes_pending: bool
    alarms: list[Alarm]
    counts: Counts
    # BGP sessions and announcements (the `bgp:` section), as the controller
    # reports them (hpclb.announce.speaker.Speaker.report); absent without one.
    bgp: dict[str, Any] | None = None
    # The fleet (the `fleet:` section): members, window and each VIP's ring
    # digest, which members compare; absent without one.
    fleet: dict[str, Any] | None = None


class CountersView(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    global_: dict[str, int] = Field(alias="global")
    drops: dict[str, int] = Field(description="every counter named drop_*, by reason")
    vips: dict[str, Counters]
    backends: dict[str, Counters]
    ports: list[dict[str, Any]]
    conns: dict[str, Any] | None


def _dataplane_stats(status: Status | None) -> Mapping[str, Any]:
    return (status or {}).get("dataplane_stats") or {}


def _rows_by_id(rows: Any) -> dict[int, Counters]:
    out = {}
    for row in rows or ():
        try:
            out[int(row[0])] = Counters(packets=int(row[1]), bytes=int(row[2]))
        except (TypeError, ValueError, IndexError):
            continue  # a malformed row counts nothing rather than failing the view
    return out


def _ids(status: Status | None, kind: str) -> Mapping[str, int]:
    return ((status or {}).get("ids") or {}).get(kind) or {}


def vip_view(vip: VipConfig, status: Status | None,
             rows: Mapping[int, Counters] | None = None) -> Vip:
    """One VIP; ``rows`` (the data plane's VIP counters by id), when the caller
    views many, is converted once for all of them."""
    vid = _ids(status, "vips").get(vip.name)
    if rows is None:
        rows = _rows_by_id(_dataplane_stats(status).get("vips"))
    counters = None if vid is None else rows.get(vid)
    return Vip(name=vip.name, address=str(vip.address), port=vip.port,
               protocol=vip.protocol.value, mode=vip.mode.value, pool=vip.pool, id=vid,
               config=vip.model_dump(mode="json", exclude={"name"}, exclude_none=True),
               counters=counters)


def vips_view(config: HpclbConfig, status: Status | None) -> list[Vip]:
    rows = _rows_by_id(_dataplane_stats(status).get("vips"))
    return [vip_view(v, status, rows) for v in config.vips]


def pool_view(config: HpclbConfig, name: str, pool: PoolConfig) -> Pool:
    return Pool(name=name, weights=pool.weights.value,
                backends=[b.name for b in pool.backends],
                vips=[v.name for v in config.vips if v.pool == name],
                config=pool.model_dump(mode="json", exclude_none=True))


def pools_view(config: HpclbConfig) -> list[Pool]:
    return [pool_view(config, name, pool) for name, pool in config.pools.items()]


def _health(status: Status | None, name: str) -> Health:
    h = ((status or {}).get("health") or {}).get(name)
    rtt = ((status or {}).get("rtt_ms") or {}).get(name)
    if not h:  # no verdict in the snapshot yet (a backend just added)
        return Health(up=False, probe_up=False, beats_missed=False, unknown=True,
                      rtt_ms=rtt, damping=None)
    return Health(up=bool(h.get("up")), probe_up=bool(h.get("probe_up", h.get("up"))),
                  beats_missed=bool(h.get("beats_missed")), unknown=bool(h.get("unknown")),
                  rtt_ms=rtt, damping=h.get("damping"))


def backend_view(pool_name: str, backend: BackendConfig, status: Status | None,
                 rows: Mapping[int, Counters] | None = None) -> Backend:
    """One backend; ``rows`` (the data plane's backend counters by id), when the
    caller views many, is converted once for all of them (1,000 backends)."""
    s = status or {}
    name = backend.name
    bid = _ids(status, "backends").get(name)
    if rows is None:
        rows = _rows_by_id(_dataplane_stats(status).get("backends"))
    counters = None if bid is None else rows.get(bid)
    live = ((s.get("weights") or {}).get(pool_name) or {}).get(name, 0.0)
    pin = (s.get("pins") or {}).get(name)
    state = (s.get("states") or {}).get(name)
    telemetry = (s.get("telemetry_latest") or {}).get(name)
    return Backend(
        name=name, pool=pool_name, address=str(backend.address), id=bid,
        admin_state=backend.state.value,
        # Not in the snapshot yet: not in the data plane yet, so it takes no flow.
        state=state if state in ("up", "draining", "down") else "down",
        health=_health(status, name),
        weight=Weight(configured=float(backend.weight), live=float(live),
                      pinned=None if not pin else Pin(weight=float(pin["weight"]),
                                                      until=float(pin["until"])),
                      inputs=(s.get("inputs") or {}).get(name)),
        telemetry=telemetry, counters=counters)


def backends_view(config: HpclbConfig, status: Status | None) -> list[Backend]:
    rows = _rows_by_id(_dataplane_stats(status).get("backends"))
    return [backend_view(pool_name, b, status, rows)
            for pool_name, pool in config.pools.items() for b in pool.backends]


def find_backend(config: HpclbConfig, name: str) -> tuple[str, BackendConfig] | None:
    for pool_name, pool in config.pools.items():
        for b in pool.backends:
            if b.name == name:
                return pool_name, b
    return None


def counters_view(config: HpclbConfig, status: Status | None) -> CountersView:
    stats = _dataplane_stats(status)
    counters = {str(k): int(v) for k, v in (stats.get("counters") or {}).items()}
    vip_rows, backend_rows = _rows_by_id(stats.get("vips")), _rows_by_id(stats.get("backends"))
    vip_ids, backend_ids = _ids(status, "vips"), _ids(status, "backends")
    return CountersView(
        global_=counters,
        drops={k: v for k, v in counters.items() if k.startswith("drop_")},
        vips={v.name: vip_rows[vip_ids[v.name]] for v in config.vips
              if vip_ids.get(v.name) in vip_rows},
        backends={name: backend_rows[bid] for name, bid in backend_ids.items()
                  if bid in backend_rows},
        ports=list(stats.get("ports") or []), conns=stats.get("conns"))


def status_view(config: HpclbConfig, status: Status | None, revision: str) -> StatusView:
    s = status or {}
    info = s.get("dataplane_info") or {}
    backends = [b.name for p in config.pools.values() for b in p.backends]
    health = s.get("health") or {}
    states = s.get("states") or {}
    up = sum(1 for b in backends if states.get(b, "up" if health.get(b, {}).get("up")
                                               else "down") == "up")
    return StatusView(
        appliance=config.appliance.name, revision=revision,
        time=float(s.get("time", 0.0)),
        dataplane=DataplaneInfo(kind=str(info.get("kind", s.get("dataplane", "unknown"))),
                                reason=str(info.get("reason", "")),
                                attach_mode=info.get("attach_mode"), pid=info.get("pid"),
                                capabilities=list(info.get("capabilities") or [])),
        pushes_pending=bool(s.get("pushes_pending", False)),
        alarms=[Alarm(source=str(a.get("source", "")), message=str(a.get("message", "")))
                for a in s.get("alarms") or []],
        counts=Counts(vips=len(config.vips), pools=len(config.pools), backends=len(backends),
                      backends_up=up),
        bgp=s.get("bgp"), fleet=s.get("fleet"))


class Finding(BaseModel):
    severity: Literal["ok", "info", "warning", "critical"]
    area: str
    title: str
    meaning: str
    next: str
    evidence: dict[str, Any]


class DiagnoseView(BaseModel):
    findings: list[Finding]
    time: float

