"""Pure renderers of the REST API's JSON for a terminal: the API's documents in,
rich renderables out (the tables of ``hpclb status``, ``vip|pool|backend
list|show``, ``stats`` and ``diagnose``), tested without a server."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

# --- formatting helpers --------------------------------------------------------------


def _si(x: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M': rates read at a glance."""
    if x is None:
        return "-"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip() if x == int(x) else f"{x:.1f} {unit}".rstrip()


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _weight(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def health_text(health: Mapping[str, Any] | None) -> Text:
    """up / down (and why: probe, heartbeats) / unknown, coloured."""
    h = health or {}
    if h.get("unknown"):
        return Text("unknown", style="yellow")
    if h.get("up"):
        rtt = h.get("rtt_ms")
        return Text("up" + (f" {rtt:.1f} ms" if isinstance(rtt, int | float) else ""),
                    style="green")
    why = [w for w, bad in (("probe", not h.get("probe_up", False)),
                            ("heartbeats", h.get("beats_missed"))) if bad]
    return Text("down" + (f" ({', '.join(why)})" if why else ""), style="bold red")


def state_text(admin: str, state: str) -> Text:
    """The operator's state and, when it differs, the data plane's."""
    style = {"up": "green", "draining": "yellow", "down": "red"}.get(state, "")
    if admin == state:
        return Text(state, style=style)
    return Text(f"{state} (admin {admin})", style=style)


def pin_text(pinned: Mapping[str, Any] | None, now: float) -> str:
    if not pinned:
        return ""
    left = max(0.0, float(pinned.get("until", now)) - now)
    return f"{_weight(pinned.get('weight'))} for {duration_text(left)}"


def duration_text(seconds: float) -> str:
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _fields(config: Mapping[str, Any]) -> str:
    """A configuration object's fields, one YAML line each (nested ones in flow style)."""
    return yaml.safe_dump(dict(config), default_flow_style=None, sort_keys=False,
                          width=4096).rstrip()


def _grid(rows: Sequence[tuple[str, RenderableType]], title: str | None = None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    if title:
        table.title = title
        table.title_justify = "left"
    return table


# --- renderers (pure: the API's JSON in, a renderable out) ----------------------------------


def render_status(status: Mapping[str, Any]) -> Table:
    dp = status.get("dataplane") or {}
    counts = status.get("counts") or {}
    alarms = status.get("alarms") or []
    dataplane = f"{dp.get('kind', '?')}"
    if dp.get("attach_mode"):
        dataplane += f" ({dp['attach_mode']})"
    if dp.get("pid") is not None:
        dataplane += f", pid {dp['pid']}"
    if dp.get("reason"):
        dataplane += f": {dp['reason']}"
    up, total = counts.get("backends_up", 0), counts.get("backends", 0)
    rows: list[tuple[str, RenderableType]] = [
        ("appliance", str(status.get("appliance", "?"))),
        ("revision", str(status.get("revision", "?"))),
        ("data plane", dataplane),
        ("capabilities", ", ".join(dp.get("capabilities") or []) or "-"),
        ("VIPs / pools", f"{counts.get('vips', 0)} / {counts.get('pools', 0)}"),
        ("backends up", Text(f"{up} of {total}", style="green" if up == total else "yellow")),
        ("pushes pending", Text("yes", style="yellow") if status.get("pushes_pending")
         else "no"),
    ]
    if status.get("time"):
        rows.append(("snapshot", time.strftime("%Y-%m-%d %H:%M:%S",
                                               time.localtime(float(status["time"])))))
    rows.append(("alarms", Text("\n".join(f"{a.get('source')}: {a.get('message')}"
                                          for a in alarms), style="bold red")
                 if alarms else Text("none", style="green")))
    rows += bgp_rows(status.get("bgp"))
    rows += fleet_rows(status.get("fleet"))
    return _grid(rows)


def fleet_rows(fleet: Mapping[str, Any] | None) -> list[tuple[str, RenderableType]]:
    """The fleet (members, window) and each VIP's ring digest: equal digests on
    every member mean the same backend in every slot."""
    if not fleet:
        return []
    members = ", ".join(str(m) for m in fleet.get("members") or []) or "not listed"
    rings = [f"{vip}: {digest}" for vip, digest in sorted((fleet.get("rings") or {}).items())]
    return [("fleet", f"{members} (window {fleet.get('window', '?')} samples)"),
            ("ring digests", "\n".join(rings) or "none")]


def bgp_rows(bgp: Mapping[str, Any] | None) -> list[tuple[str, RenderableType]]:
    """BGP sessions (state, uptime) and announcements (state, reason)."""
    if not bgp:
        return []
    sessions = [Text(f"{s.get('name')} {s.get('peer')} AS{s.get('asn')}: {s.get('state')}"
                     + (f" for {duration_text(float(s['uptime_s']))}"
                        if s.get("uptime_s") is not None else ""),
                     style="green" if s.get("established") else "bold red")
                for s in bgp.get("sessions") or []]
    if not bgp.get("reachable", True):
        sessions.insert(0, Text(f"speaker unreachable: {bgp.get('error')}", style="bold red"))
    style = {"announced": "green", "suppressed": "yellow", "withdrawn": "red"}
    announcements = [Text(f"{a.get('address')}: {a.get('state')} ({a.get('reason')})",
                          style=style.get(str(a.get("state")), ""))
                     for a in bgp.get("announcements") or []]
    return [("BGP sessions", Text("\n").join(sessions) if sessions else Text("none")),
            ("announcements", Text("\n").join(announcements) if announcements
             else Text("none"))]


def vips_table(vips: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="VIPs", title_justify="left")
    for col in ("name", "address", "mode", "pool"):
        table.add_column(col, no_wrap=True)
    table.add_column("packets", justify="right")
    table.add_column("bytes", justify="right")
    for v in vips:
        c = v.get("counters") or {}
        table.add_row(str(v["name"]), f"{v['address']}:{v['port']}/{v['protocol']}",
                      str(v.get("mode", "")), str(v.get("pool", "")),
                      _count(c.get("packets")), _count(c.get("bytes")))
    return table


def render_vip(vip: Mapping[str, Any]) -> Group:
    c = vip.get("counters") or {}
    return Group(_grid([
        ("VIP", str(vip["name"])),
        ("address", f"{vip['address']}:{vip['port']}/{vip['protocol']}"),
        ("mode", str(vip.get("mode", ""))), ("pool", str(vip.get("pool", ""))),
        ("id", str(vip.get("id") if vip.get("id") is not None else "- (not pushed yet)")),
        ("packets / bytes", f"{_count(c.get('packets'))} / {_count(c.get('bytes'))}"),
        ("configuration", _fields(vip.get("config") or {})),
    ]))


def pools_table(pools: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="pools", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("weights", no_wrap=True)
    table.add_column("backends", justify="right")
    table.add_column("members")
    table.add_column("VIPs")
    for p in pools:
        members = list(p.get("backends") or [])
        table.add_row(str(p["name"]), str(p.get("weights", "")), str(len(members)),
                      ", ".join(members), ", ".join(p.get("vips") or []))
    return table


def render_pool(pool: Mapping[str, Any]) -> Group:
    config = dict(pool.get("config") or {})
    config.pop("backends", None)  # listed above, and per backend by `backend list`
    return Group(_grid([
        ("pool", str(pool["name"])), ("weights", str(pool.get("weights", ""))),
        ("backends", ", ".join(pool.get("backends") or []) or "none"),
        ("VIPs", ", ".join(pool.get("vips") or []) or "none"),
        ("configuration", _fields(config) if config else "-"),
    ]))


def backends_table(backends: Sequence[Mapping[str, Any]], now: float,
                   title: str = "backends") -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("name", "pool", "address", "health", "state"):
        table.add_column(col, no_wrap=True)
    table.add_column("weight live/conf", justify="right", no_wrap=True)
    table.add_column("pin", no_wrap=True)
    table.add_column("packets", justify="right")
    for b in backends:
        w = b.get("weight") or {}
        c = b.get("counters") or {}
        table.add_row(str(b["name"]), str(b.get("pool", "")), str(b.get("address", "")),
                      health_text(b.get("health")),
                      state_text(str(b.get("admin_state", "")), str(b.get("state", ""))),
                      f"{_weight(w.get('live'))} / {_weight(w.get('configured'))}",
                      pin_text(w.get("pinned"), now), _count(c.get("packets")))
    return table


def render_backend(b: Mapping[str, Any], now: float) -> Group:
    w = b.get("weight") or {}
    c = b.get("counters") or {}
    rows: list[tuple[str, RenderableType]] = [
        ("backend", str(b["name"])), ("pool", str(b.get("pool", ""))),
        ("address", str(b.get("address", ""))),
        ("health", health_text(b.get("health"))),
        ("state", state_text(str(b.get("admin_state", "")), str(b.get("state", "")))),
        ("weight", f"live {_weight(w.get('live'))}, configured {_weight(w.get('configured'))}"),
    ]
    if w.get("pinned"):
        rows.append(("pinned", pin_text(w["pinned"], now)))
    if w.get("inputs"):
        rows.append(("weight inputs", json.dumps(w["inputs"], sort_keys=True)))
    telemetry = b.get("telemetry")
    if telemetry:
        age = telemetry.get("age_s")
        rows.append(("telemetry", "received" + (f" {age:.1f} s ago"
                                                  if isinstance(age, int | float) else "")))
    rows.append(("packets / bytes", f"{_count(c.get('packets'))} / {_count(c.get('bytes'))}"))
    return Group(_grid(rows))


def last_sample(history: Mapping[str, Any]) -> dict[str, Any] | None:
    """The newest point of GET /history's series: {"t", "vips": {name: {pps, bps}},
    "backends": {name: {pps, share, weight, up}}}; None when there is none yet."""
    t = history.get("t") or []
    if not t:
        return None
    return {"t": t[-1],
            "vips": {n: {k: s[k][-1] for k in s if s[k]}
                     for n, s in (history.get("vips") or {}).items()},
            "backends": {n: {k: s[k][-1] for k in s if s[k]}
                         for n, s in (history.get("backends") or {}).items()}}


def render_stats(vips: Sequence[Mapping[str, Any]], backends: Sequence[Mapping[str, Any]],
                 counters: Mapping[str, Any], sample: Mapping[str, Any] | None,
                 now: float) -> Group:
    """One frame of `hpclb stats`: per VIP and per backend packet rates (the
    API's last one-second sample), health, state and weight; then the global
    counters and the drops by reason."""
    vip_rates = (sample or {}).get("vips") or {}
    backend_rates = (sample or {}).get("backends") or {}
    vt = Table(title="VIPs", title_justify="left")
    for col in ("name", "address", "pool"):
        vt.add_column(col, no_wrap=True)
    for col in ("packets/s", "bits/s", "packets"):
        vt.add_column(col, justify="right", no_wrap=True)
    for v in vips:
        r = vip_rates.get(v["name"]) or {}
        c = v.get("counters") or {}
        vt.add_row(str(v["name"]), f"{v['address']}:{v['port']}/{v['protocol']}",
                   str(v.get("pool", "")), _si(r.get("pps")), _si(r.get("bps"), "b"),
                   _count(c.get("packets")))
    bt = Table(title="backends", title_justify="left")
    for col in ("name", "pool", "health", "state"):
        bt.add_column(col, no_wrap=True)
    for col in ("weight live/conf", "pin", "packets/s", "share", "packets"):
        bt.add_column(col, justify="right" if col != "pin" else "left", no_wrap=True)
    for b in backends:
        r = backend_rates.get(b["name"]) or {}
        w = b.get("weight") or {}
        c = b.get("counters") or {}
        share = r.get("share")
        bt.add_row(str(b["name"]), str(b.get("pool", "")), health_text(b.get("health")),
                   state_text(str(b.get("admin_state", "")), str(b.get("state", ""))),
                   f"{_weight(w.get('live'))} / {_weight(w.get('configured'))}",
                   pin_text(w.get("pinned"), now), _si(r.get("pps")),
                   "-" if share is None else f"{100 * share:.0f} %", _count(c.get("packets")))
    glob = counters.get("global") or {}
    drops = counters.get("drops") or {}
    worst = sorted(((n, v) for n, v in drops.items() if v), key=lambda kv: -kv[1])[:4]
    line = Text(f"rx {_count(glob.get('rx'))}  forwarded {_count(glob.get('fwd_tx'))}  ")
    line.append(f"drops {_count(sum(drops.values()))}",
                style="yellow" if sum(drops.values()) else "")
    if worst:
        line.append(" (" + ", ".join(f"{n} {_count(v)}" for n, v in worst) + ")")
    at = (sample or {}).get("t")
    line.append("   rates of " + (time.strftime("%H:%M:%S", time.localtime(float(at)))
                                  if at else "- (no sample yet)"), style="dim")
    return Group(vt, bt, line)


def findings_table(body: Mapping[str, Any]) -> Table:
    """diagnose's findings as a plain table (when the richer renderer is absent)."""
    table = Table(title="hpclb diagnose", show_lines=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("area", no_wrap=True)
    table.add_column("finding")
    styles = {"ok": "green", "info": "cyan", "warning": "yellow", "critical": "bold red"}
    for f in body.get("findings") or []:
        text = Text(str(f.get("title", "")), style="bold")
        for label, key in (("", "meaning"), ("next: ", "next")):
            if f.get(key):
                text.append(f"\n{label}{f[key]}")
        severity = str(f.get("severity", "?"))
        table.add_row(Text(severity, style=styles.get(severity, "")), str(f.get("area", "")),
                      text)
    return table
