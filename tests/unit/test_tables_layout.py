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
}



def _probe_source() -> str:
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "lb_tables.h"',
             'static const char *names[] = LB_STAT_NAMES;', 'int main(void) {', 'printf("{");']
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("\\"{struct}\\": [%zu", sizeof(struct {struct}));')
        for field in dtype.names or ():
            lines.append(f'printf(", %zu", offsetof(struct {struct}, {field}));')
        lines.append('printf("], ");')
    for name in CONSTANTS:
        lines.append(f'printf("\\"{name}\\": %llu, ", (unsigned long long)({name}));')
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


def test_constants(header_facts: dict) -> None:
    for name, value in CONSTANTS.items():
        assert header_facts[name] == value, name


def test_stat_names(header_facts: dict) -> None:
    assert tuple(header_facts["names"]) == tables.STAT_NAMES
