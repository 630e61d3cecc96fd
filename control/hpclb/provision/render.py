"""The files provisioning writes: templates and the configuration from an example.

The configuration is the example (``appliance/examples/*.yaml``) round-tripped
with ruamel (:class:`hpclb.config.document.ConfigDocument`): the operator's
comments and layout stay, only the host's values are put in (name, interfaces,
management address, data plane, lcores, hugepages, key paths, a fresh
hash_key). The result is checked with the same loader ``hpclb check`` uses;
an example that is not valid, or that the host's values make invalid, is a
:class:`ProvisionError` naming the file and each problem, before anything is
written.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from hpclb.config import ConfigError, parse_config
from hpclb.config.document import ConfigDocument, EditError
from hpclb.provision.plan import ProvisionError

#: Where provisioning puts what the control plane reads.
CONFIG = "/etc/hpclb/hpclb.yaml"
CURVE_DIR = "/etc/hpclb/curve"
SERVER_SECRET = f"{CURVE_DIR}/server.key_secret"
SERVER_PUBLIC = f"{CURVE_DIR}/server.key"
ALLOW_DIR = f"{CURVE_DIR}/agents"

#: Test seam only: a fixed hash_key, so that golden files are stable. Never
#: set it on an appliance: the key must be secret and random.
HASH_KEY_ENV = "HPCLB_PROVISION_TEST_HASH_KEY"
HASH_KEY_BYTES = 16


def template(name: str) -> str:
    """The text of ``control/hpclb/templates/provision/<name>``."""
    return (files("hpclb") / "templates" / "provision" / name).read_text()


def new_hash_key() -> str:
    """A fresh random hash_key (hex); the test seam's when set."""
    fixed = os.environ.get(HASH_KEY_ENV)
    return fixed if fixed else secrets.token_hex(HASH_KEY_BYTES)


@dataclass(frozen=True)
class ConfigInputs:
    """The host's values put into the example; None keeps the example's."""

    name: str
    hash_key: str
    dataplane: str | None = None
    ingress: str | None = None
    egress: Sequence[str] | None = None
    management_address: str | None = None
    lcores: Sequence[int] | None = None
    hugepages_mb: int | None = None


def _problems(err: ConfigError, source: str) -> str:
    lines = str(err).splitlines()
    return "\n".join(f"  {line}" if line.startswith(source) else f"  {source}: {line}"
                     for line in lines)


def check_config(text: str, source: str) -> None:
    """``text`` is a valid configuration (``hpclb check --schema-only``), else
    a ProvisionError listing the problems."""
    try:
        parse_config(text, source)
    except ConfigError as err:
        raise ProvisionError(f"{source} is not a valid configuration:\n"
                             f"{_problems(err, source)}") from None


def _section(root: CommentedMap, key: str, source: str) -> CommentedMap:
    node = root.get(key)
    if node is None:
        node = root[key] = CommentedMap()
    if not isinstance(node, CommentedMap):
        raise ProvisionError(f"{source}: {key!r} is not a mapping")
    return node


def _set_list(mapping: CommentedMap, key: str, values: Sequence[Any]) -> None:
    """Replace a list's items in place, so its style (flow ``[a, b]`` or
    block) and its end-of-line comment stay."""
    node = mapping.get(key)
    if isinstance(node, CommentedSeq):
        del node[:]
        node.extend(values)
        return
    seq = CommentedSeq(values)
    seq.fa.set_flow_style()
    mapping[key] = seq


def render_config(example: str, source: str, inputs: ConfigInputs) -> str:
    """The configuration: ``example`` (its text, from file ``source``) with
    ``inputs`` put in. Raises ProvisionError when the example or the result
    is not a valid configuration."""
    check_config(example, source)  # the operator's example first: its own problems
    try:
        doc = ConfigDocument.parse(example, source)
    except EditError as err:
        raise ProvisionError(err.message) from None
    app = _section(doc.root, "appliance", source)
    app["name"] = inputs.name
    app["hash_key"] = inputs.hash_key
    if inputs.dataplane is not None:
        app["dataplane"] = inputs.dataplane
    if inputs.management_address is not None:
        app["management_address"] = inputs.management_address
    if inputs.ingress is not None or inputs.egress is not None:
        ifs = _section(app, "interfaces", source)
        if inputs.ingress is not None:
            ifs["ingress"] = inputs.ingress
        if inputs.egress is not None:
            old = ifs.get("egress")
            if isinstance(old, list) and len(old) == len(inputs.egress):
                # The example's i-th egress port is this host's i-th: the
                # backends behind it (`via`) follow it.
                _rename_via(doc.root, dict(zip(old, inputs.egress, strict=True)))
            _set_list(ifs, "egress", list(inputs.egress))
    if inputs.lcores is not None or inputs.hugepages_mb is not None:
        dpdk = _section(app, "dpdk", source)
        if inputs.lcores is not None:
            _set_list(dpdk, "lcores", list(inputs.lcores))
            main, *workers = inputs.lcores
            _comment(dpdk, "lcores", f"main lcore {main}, workers "
                     f"{', '.join(map(str, workers))} (picked by provision: the NICs' NUMA node)")
        if inputs.hugepages_mb is not None:
            dpdk["hugepages_mb"] = inputs.hugepages_mb
            _comment(dpdk, "hugepages_mb", "reserved at boot by hpclb-prepare.service")
    tele = doc.root.get("telemetry")
    if isinstance(tele, CommentedMap):
        tele["server_key"] = SERVER_SECRET
        tele["allow_dir"] = ALLOW_DIR
        bind = tele.get("bind")
        if inputs.management_address is not None and isinstance(bind, str):
            # The receiver listens on the management address (never a VIP).
            port = bind.rpartition(":")[2]
            tele["bind"] = f"tcp://{_host(inputs.management_address)}:{port}"
    text = doc.text()
    check_config(text, f"{source} (as rendered for this host)")
    return text


def _comment(mapping: CommentedMap, key: str, text: str) -> None:
    """Replace ``key``'s end-of-line comment (the example's describes the
    example's value), at the column the old one had."""
    old = mapping.ca.items.get(key)
    token = old[2] if old and len(old) > 2 else None
    column = getattr(token, "column", None)
    if token is not None:
        # Keep what followed the comment on later lines (blank lines, comments).
        rest = token.value.split("\n", 1)[1] if "\n" in token.value else ""
        token.value = f"# {text}\n{rest}"
        return
    mapping.yaml_add_eol_comment(f"# {text}", key, column=column or 0)


def _rename_via(root: CommentedMap, names: dict[str, str]) -> None:
    pools = root.get("pools")
    if not isinstance(pools, dict):
        return
    for pool in pools.values():
        backends = pool.get("backends") if isinstance(pool, dict) else None
        for backend in backends if isinstance(backends, list) else ():
            via = backend.get("via") if isinstance(backend, dict) else None
            if isinstance(via, str) and via in names:
                backend["via"] = names[via]


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
