"""What a configuration needs from the host, checked before anything is used.

``hpclb check`` runs these after the schema (so does ``hpclb run`` before it
adopts or starts anything, and a reload before it pushes): key files that
exist and hold what they should, service addresses that are the appliance's
own (in its network namespace), a namespace that exists, the CA files of
https probes (read as the health checker reads them, which would otherwise
only find out when it probes the first backend). Each problem is one
sentence naming the field and the file or address; nothing is changed.

What cannot be known without taking it (a port another process holds) is
found when ``hpclb run`` binds it, still before any data plane is touched.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

from hpclb.config import ConfigError, ConfigIssue, HpclbConfig
from hpclb.health import tls_context
from hpclb.host.netns import inside
from hpclb.telemetry.receiver import AllowListError, load_allow_list, load_server_key


def _netns_problem(netns: str | None) -> str | None:
    if netns is None:
        return None
    path = Path(netns) if "/" in netns else Path("/run/netns") / netns
    return None if path.exists() else f"appliance.netns: {netns} does not exist ({path})"


Address = IPv4Address | IPv6Address


def _host_address(host: str) -> Address:
    """A service's host as the schema accepts it: IPv4, or IPv6 in brackets."""
    return ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)


def _not_local(addresses: list[Address], netns: str | None) -> list[Address]:
    """Those of ``addresses`` that no interface of the namespace holds: binding
    one fails with EADDRNOTAVAIL (port 0, so nothing else is disturbed)."""
    def probe() -> list[Address]:
        missing = []
        for addr in addresses:
            family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                try:
                    s.bind((str(addr), 0))
                except OSError as err:
                    if err.errno != errno.EADDRNOTAVAIL:
                        raise
                    missing.append(addr)
        return missing

    if netns is None:
        return probe()
    with inside(netns):
        return probe()


def service_addresses(config: HpclbConfig) -> Iterator[tuple[str, Address]]:
    """(field, address) of every address a service of the appliance binds."""
    app = config.appliance
    if app.management_address is not None:
        yield "appliance.management_address", app.management_address
    if config.telemetry is not None:
        host = config.telemetry.bind_host
        addr = _host_address(host) if host else app.management_address
        if addr is not None:  # the schema requires one or the other
            yield "telemetry.bind", addr
    if app.metrics_endpoint is not None:
        yield "appliance.metrics", _host_address(app.metrics_endpoint[0])
    if app.api is not None:
        yield "appliance.api.listen", _host_address(app.api.endpoint(app.management_address)[0])


def ca_file_problems(config: HpclbConfig) -> list[str]:
    """``pools.<p>.probe.ca_file: ...`` for each https probe whose CA file
    cannot be read or holds no certificate (each file loaded once)."""
    problems: list[str] = []
    seen: dict[tuple[bool, str], str | None] = {}
    for name, pool in config.pools.items():
        probe = pool.probe
        if probe is None or probe.kind != "https" or probe.ca_file is None:
            continue  # no CA file: the system's trust store
        key = (probe.verify, str(probe.ca_file))
        if key not in seen:
            try:
                tls_context(*key)
                seen[key] = None
            except ValueError as err:
                seen[key] = str(err)
        if (reason := seen[key]) is not None:
            problems.append(f"pools.{name}.probe.ca_file: {reason}")
    return problems


def host_problems(config: HpclbConfig) -> list[str]:
    """Everything the host lacks for ``config``; empty when it can run."""
    problems: list[str] = ca_file_problems(config)
    netns = config.appliance.netns
    if (p := _netns_problem(netns)) is not None:
        # Addresses cannot be looked up in a namespace that is not there.
        return [p, *problems]
    t = config.telemetry
    if t is not None:
        try:
            if not t.server_key.is_file():
                raise AllowListError(f"{t.server_key} does not exist")
            load_server_key(t.server_key)
        except (AllowListError, OSError) as err:
            problems.append(f"telemetry.server_key: {err}")
        try:
            load_allow_list(t.allow_dir)
        except AllowListError as err:
            problems.append(f"telemetry.allow_dir: {err}")
    fields: dict[Address, list[str]] = {}
    for field, addr in service_addresses(config):
        fields.setdefault(addr, []).append(field)
    try:
        missing = _not_local(list(fields), netns)
    except OSError as err:
        return [*problems, f"cannot look up the appliance's addresses: {err}"]
    where = f"namespace {netns}" if netns else "this host"
    for addr in missing:
        problems.append(f"{', '.join(fields[addr])}: {addr} is not an address of {where}")
    return problems


def check_host(config: HpclbConfig, source: str) -> None:
    """ConfigError naming every problem of :func:`host_problems`."""
    problems = host_problems(config)
    if problems:
        raise ConfigError([ConfigIssue(source, None, None, "", p) for p in problems])
