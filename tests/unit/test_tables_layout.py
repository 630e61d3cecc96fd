"""The Python mirror of dataplane/common/lb_tables.h agrees with the header.

Compiles a probe against the real header and compares every struct size,
every field offset and every constant with hpclb.contract.tables (and the
limits hpclb.config enforces).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hpclb.contract import tables

COMMON = Path(__file__).resolve().parents[2] / "dataplane" / "common"

STRUCTS = {
    "lb_vip_key": tables.VIP_KEY_DTYPE,
    "lb_vip_entry": tables.VIP_ENTRY_DTYPE,
    "lb_backend": tables.BACKEND_DTYPE,
    "lb_ring_patch": tables.RING_PATCH_DTYPE,
    "lb_flow_key": tables.FLOW_KEY_DTYPE,
    "lb_flow_entry": tables.FLOW_ENTRY_DTYPE,
    "lb_port": tables.PORT_DTYPE,
    "lb_counter": tables.COUNTER_DTYPE,
    "lb_config": tables.CONFIG_DTYPE,
    # NAT mode's connection table: not on the wire, mirrored for the model.
    "lb_flow_key_v4": tables.FLOW_KEY_V4_DTYPE,
    "lb_conn": tables.CONN_DTYPE,
    "lb_nat_config": tables.NAT_CONFIG_DTYPE,
    "lb_conn6": tables.CONN6_DTYPE,
}

CONSTANTS = {
    "LB_PROTOCOL_VERSION": tables.PROTOCOL_VERSION,
    "LB_MAX_VIPS": tables.MAX_VIPS,
    "LB_MAX_BACKENDS": tables.MAX_BACKENDS,
    "LB_RING_SIZE_DEFAULT": tables.RING_SIZE_DEFAULT,
    "LB_RING_SIZE_MAX": tables.RING_SIZE_MAX,
    "LB_MAX_PORTS": tables.MAX_PORTS,
    "LB_MAX_FLOWS": tables.MAX_FLOWS,
    "LB_HASH_KEY_LEN": tables.HASH_KEY_LEN,
    "LB_RING_PROBES": tables.RING_PROBES,
    "LB_NO_BACKEND": tables.NO_BACKEND,
    "LB_STAT_MAX": len(tables.STAT_NAMES),
    "LB_BACKEND_UP": int(tables.BackendState.UP),
    "LB_BACKEND_DRAINING": int(tables.BackendState.DRAINING),
    "LB_BACKEND_DOWN": int(tables.BackendState.DOWN),
    "LB_BACKEND_UNUSED": int(tables.BackendState.UNUSED),
    "LB_MODE_DSR": int(tables.VipMode.DSR),
    "LB_MODE_NAT": int(tables.VipMode.NAT),
    "LB_MODE_TUNNEL": int(tables.VipMode.TUNNEL),
    "LB_FAMILY_V4": int(tables.Family.V4),
    "LB_FAMILY_V6": int(tables.Family.V6),
    "sizeof(union lb_addr)": 16,
    "LB_CONN_STATES": len(tables.CONN_STATE_NAMES),
    "LB_CONN_TABLE_DEFAULT": tables.CONN_TABLE_DEFAULT,
    "LB_CONN_TABLE_MIN": tables.CONN_TABLE_MIN,
    "LB_CONN_TABLE_MAX": tables.CONN_TABLE_MAX,
    "LB_CONN_EVICT_TRIES": tables.CONN_EVICT_TRIES,
    "LB_MAX_SNAT_ADDRS": tables.MAX_SNAT_ADDRS,
    "LB_SNAT_PROBES": tables.SNAT_PROBES,
    "LB_VIP_F_SNAT": tables.VIP_F_SNAT,
    "LB_CONN_F_SNAT": tables.CONN_F_SNAT,
    "LB_NAT_DOWN_RESCHEDULE": int(tables.NatDown.RESCHEDULE),
    "LB_NAT_DOWN_DROP": int(tables.NatDown.DROP),
    "LB_ENCAP_IPIP": int(tables.Encap.IPIP),
    "LB_ENCAP_GUE": int(tables.Encap.GUE),
    "LB_GUE_PORT_DEFAULT": tables.GUE_PORT_DEFAULT,
    "LB_TUNNEL_SRC_BITS_MAX": tables.TUNNEL_SRC_BITS_MAX,
    **{f"LB_CONN_{s.name}": int(s) for s in tables.ConnState},
}

# Sizes the wire and the maps were designed with (table protocol 2): a change
# here is a protocol change, not a refactoring.
SIZES = {
    "lb_vip_key": 20,
    "lb_vip_entry": 32,  # 24 until NAT mode's nat_flags, 28 until tunnel mode
    "lb_backend": 28,
    "lb_flow_key": 40,
}

# The XDP plane's compact IPv4 VIP key (lb_tables.h): not on the wire, so no
# Python mirror; its layout is the table-protocol-1 one. (lb_flow_key_v4,
# byte for byte the tuple lb_flow_hash hashes an IPv4 flow over, is mirrored
# above: the connection table's entries name one another by it.)
COMPACT_KEYS = {
    "lb_vip_key_v4": (8, {"addr": 0, "port": 4, "proto": 6, "pad": 7}),
}


def _probe_source() -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "lb_tables.h"',
             'static const char *names[] = LB_STAT_NAMES;', 'int main(void) {', 'printf("{");']
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("\\"{struct}\\": [%zu", sizeof(struct {struct}));')
        for field in dtype.names or ():
            lines.append(f'printf(", %zu", offsetof(struct {struct}, {field}));')
        lines.append('printf("], ");')
    for struct, (_, fields) in COMPACT_KEYS.items():
        lines.append(f'printf("\\"{struct}\\": [%zu", sizeof(struct {struct}));')
        for field in fields:
            lines.append(f'printf(", %zu", offsetof(struct {struct}, {field}));')
        lines.append('printf("], ");')
    for name in CONSTANTS:
        lines.append(f'printf("\\"{name}\\": %llu, ", (unsigned long long)({name}));')
    # The union's members all start at 0 and cover its 16 bytes.
    lines.append('printf("\\"lb_addr\\": [%zu, %zu, %zu, %zu], ", sizeof(union lb_addr), '
                 'offsetof(union lb_addr, v4), offsetof(union lb_addr, v6w), '
                 'offsetof(union lb_addr, v6));')
    lines += ['static const char *states[] = LB_CONN_STATE_NAMES;',
              'static const unsigned timeouts[] = LB_CONN_TIMEOUTS_DEFAULT;',
              'printf("\\"states\\": [");',
              'for (unsigned i = 0; i < LB_CONN_STATES; i++)',
              '  printf("%s\\"%s\\"", i ? ", " : "", states[i]);',
              'printf("], \\"timeouts\\": [");',
              'for (unsigned i = 0; i < LB_CONN_STATES; i++)',
              '  printf("%s%u", i ? ", " : "", timeouts[i]);',
              'printf("], ");']
    lines += ['printf("\\"names\\": [");',
              'for (unsigned i = 0; i < LB_STAT_MAX; i++)',
              '  printf("%s\\"%s\\"", i ? ", " : "", names[i]);',
              'printf("]}\\n");', 'return 0; }']
    return "\n".join(lines)


@pytest.fixture(scope="module")
def header_facts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to compile the layout probe")
    tmp = tmp_path_factory.mktemp("layout")
    (tmp / "probe.c").write_text(_probe_source())
    subprocess.run([cc, "-Wall", "-Wextra", "-Werror", f"-I{COMMON}", "-o", str(tmp / "probe"),
                    str(tmp / "probe.c")], check=True)
    out = subprocess.run([str(tmp / "probe")], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out))


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_struct_layout(header_facts: dict, struct: str) -> None:
    dtype: np.dtype = STRUCTS[struct]
    size, *offsets = header_facts[struct]
    assert dtype.itemsize == size
    assert [dtype.fields[f][1] for f in dtype.names or ()] == offsets  # type: ignore[index]


@pytest.mark.parametrize("struct", sorted(SIZES))
def test_protocol_2_sizes(header_facts: dict, struct: str) -> None:
    assert header_facts[struct][0] == SIZES[struct] == STRUCTS[struct].itemsize


@pytest.mark.parametrize("struct", sorted(COMPACT_KEYS))
def test_compact_ipv4_keys(header_facts: dict, struct: str) -> None:
    size, fields = COMPACT_KEYS[struct]
    assert header_facts[struct] == [size, *fields.values()]


def test_flow_key_v4_is_the_hashed_tuple(header_facts: dict) -> None:
    from hpclb.contract import flowhash

    assert header_facts["lb_flow_key_v4"][0] == flowhash._FLOW_TUPLE_V4.size


def test_addr_union(header_facts: dict) -> None:
    assert header_facts["lb_addr"] == [16, 0, 0, 0]
    for dtype, field in ((tables.VIP_KEY_DTYPE, "addr"), (tables.BACKEND_DTYPE, "addr"),
                         (tables.VIP_ENTRY_DTYPE, "tunnel_src"), (tables.FLOW_KEY_DTYPE, "saddr"),
                         (tables.FLOW_KEY_DTYPE, "daddr")):
        assert dtype.fields[field][0].itemsize == 16, field  # type: ignore[index]


def test_constants(header_facts: dict) -> None:
    for name, value in CONSTANTS.items():
        assert header_facts[name] == value, name


def test_stat_names(header_facts: dict) -> None:
    assert tuple(header_facts["names"]) == tables.STAT_NAMES


def test_conn_state_names_and_timeouts(header_facts: dict) -> None:
    assert tuple(header_facts["states"]) == tables.CONN_STATE_NAMES
    assert [s.name.lower() for s in tables.ConnState] == list(tables.CONN_STATE_NAMES)
    assert tuple(header_facts["timeouts"]) == tables.CONN_TIMEOUTS_DEFAULT
