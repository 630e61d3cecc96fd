"""Build outputs are found through the install manifest (install.py), never by
walking up the source tree; without the C Maglev fill, start warns or refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpclb.balancing import maglev
from hpclb.config import parse_config
from hpclb.controller.core import PYTHON_FILL_MAX_S, check_maglev_fill
from hpclb.host import install

PACKAGE = Path(install.__file__).parent

# A pool of 3 on the default ring: the Python fill is slow but bearable (warning).
SMALL = """\
appliance:
  name: gw1
  interfaces: {ingress: eth0}
  hash_key: 000102030405060708090a0b0c0d0e0f
  ring_size: 65537
pools:
  web:
    backends:
      - {name: b1, address: 198.18.0.11}
      - {name: b2, address: 198.18.0.12}
      - {name: b3, address: 198.18.0.13}
vips:
  - {name: svc, address: 198.18.1.10, port: 8080, protocol: tcp, pool: web}
"""


def big_config(backends: int = 1000, ring_size: int = 1048573) -> str:
    """A pool of ``backends`` on a ring of ``ring_size``: seconds in Python."""
    lines = [f"  ring_size: {ring_size}" if line.startswith("  ring_size:") else line
             for line in SMALL.splitlines() if not line.startswith("      - {name: b")]
    at = lines.index("    backends:") + 1
    lines[at:at] = [f"      - {{name: n{i}, address: 10.1.{i // 250}.{i % 250 + 1}}}"
                    for i in range(backends)]
    return "\n".join(lines) + "\n"


def write_manifest(path: Path, outputs: dict[str, str], fmt: int = 1) -> None:
    path.write_text(json.dumps({"format": fmt, "outputs": outputs}))


@pytest.fixture
def manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """install.MANIFEST moved to a scratch file (not written yet); no override set."""
    path = tmp_path / "_installed.json"
    monkeypatch.setattr(install, "MANIFEST", path)
    for output in install.OUTPUTS.values():
        if output.env:
            monkeypatch.delenv(output.env, raising=False)
    return path


def test_the_build_wrote_a_manifest_of_every_output() -> None:
    """make -C dataplane records every output install.py knows, by absolute path,
    and each is there."""
    try:
        outputs = install.read_manifest()
    except install.MissingBuildOutput as err:
        pytest.fail(str(err))
    assert set(outputs) == set(install.OUTPUTS)
    assert all(Path(p).is_absolute() for p in outputs.values())
    env = {o.env for o in install.OUTPUTS.values() if o.env}
    if not any(os.environ.get(v) for v in env):
        for name in install.OUTPUTS:
            assert install.find(name) == Path(outputs[name])


def test_an_override_wins_and_is_taken_at_its_word(manifest: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    built = tmp_path / "hpclb-xdp"
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    mine = tmp_path / "my-xdp"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    write_manifest(manifest, {"hpclb-xdp": str(built)})
    assert install.find("hpclb-xdp") == built
    monkeypatch.setenv("HPCLB_XDP_BIN", str(mine))
    assert install.find("hpclb-xdp") == mine
    # Naming nothing, or a file that does not run: an error naming the
    # variable, never the manifest's build instead.
    for bad in (tmp_path / "nothing", tmp_path / "_installed.json"):
        monkeypatch.setenv("HPCLB_XDP_BIN", str(bad))
        with pytest.raises(install.MissingBuildOutput,
                           match=r"HPCLB_XDP_BIN=.*unset HPCLB_XDP_BIN"):
            install.find("hpclb-xdp")


def test_without_a_manifest_the_error_says_what_to_run(manifest: Path) -> None:
    with pytest.raises(install.MissingBuildOutput) as err:
        install.find("hpclb-dpdk")
    assert str(manifest) in str(err.value)
    assert "run ./bootstrap (or make -C dataplane)" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)  # what callers catch


@pytest.mark.parametrize("text, says", [
    ("not json", "unreadable"),
    ('{"format": 2, "outputs": {}}', "not format 1"),
    ("[]", "not format 1"),
    ('{"format": 1, "outputs": {}}', "not in the install manifest"),
    ('{"format": 1, "outputs": {"pass.bpf.o": "build/pass.bpf.o"}}', "relative path"),
    ('{"format": 1, "outputs": {"pass.bpf.o": "/nonexistent/pass.bpf.o"}}',
     "pass.bpf.o not built: /nonexistent/pass.bpf.o is not a file"),
])
def test_a_bad_manifest_or_a_missing_output_is_one_clear_error(
        manifest: Path, text: str, says: str) -> None:
    manifest.write_text(text)
    with pytest.raises(install.MissingBuildOutput, match="make -C dataplane") as err:
        install.find("pass.bpf.o")
    assert says in str(err.value)


def test_no_module_walks_up_to_the_build() -> None:
    """Every build output goes through install.find: no module of the control
    plane names the build folder or climbs out of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "install.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
            assert "dataplane/build" not in line and '"build"' not in line, where
            assert "REPO_ROOT" not in line, where
            # The one exception: lab/topology.py hands its subprocesses the package's
            # import root (where `hpclb` imports from), not a build output.
            assert "parents[" not in line or "_PYTHONPATH" in line, where


def test_with_the_c_fill_nothing_is_said(caplog: pytest.LogCaptureFixture) -> None:
    if maglev.c_fill_missing() is not None:
        pytest.fail(maglev.c_fill_missing())
    check_maglev_fill(parse_config(big_config()))
    assert "Maglev" not in caplog.text


def test_the_python_fill_estimate_brackets_the_measurements() -> None:
    """Within a factor of 2 of what the 2-core lab host measured (build_table,
    use_c=False); the refusal below rests on it."""
    for backends, size, measured_s in ((3, 65537, 0.018), (1000, 65537, 0.080),
                                       (100, 262147, 0.31), (1000, 1048573, 4.8)):
        estimate = maglev.python_fill_estimate_s(backends, size)
        assert measured_s / 2 < estimate < measured_s * 2, (backends, size)
    assert maglev.python_fill_estimate_s(1, 1048573) == 0.0


def test_without_the_c_fill_start_warns_or_refuses(tmp_path: Path) -> None:
    """HPCLB_MAGLEV_LIB naming no file (a fresh process: the fill is loaded at
    import): a small configuration starts with one warning naming the cost; a
    pool whose rings would take over PYTHON_FILL_MAX_S is refused by start(),
    before anything else is touched (an empty Controller gets no further)."""
    script = textwrap.dedent("""
        import logging, sys
        from hpclb.balancing import maglev
        from hpclb.config import parse_config
        from hpclb.controller.core import Controller, StartError, check_maglev_fill

        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
        print("MISSING", maglev.c_fill_missing())
        ring = maglev.build_table([(0, "a", 1.0), (1, "b", 1.0)], 251)  # still builds
        print("RING", len(ring), sorted(set(ring.tolist())))
        check_maglev_fill(parse_config(sys.argv[1]))
        controller = Controller.__new__(Controller)
        controller.config, controller.decider = parse_config(sys.argv[2]), None
        try:
            controller.start()
        except StartError as err:
            print("REFUSED", err)
    """)
    env = dict(os.environ, HPCLB_MAGLEV_LIB=str(tmp_path / "libhpclb_maglev.so"))
    res = subprocess.run([sys.executable, "-c", script, SMALL, big_config()], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith("MISSING libhpclb_maglev.so: HPCLB_MAGLEV_LIB=")
    assert out[1] == "RING 251 [0, 1]"
    warnings = [line for line in out if line.startswith("WARNING")]
    assert len(warnings) == 1, out
    assert "Maglev fill in Python, 4-30x slower than in C" in warnings[0]
    assert "(largest: pool web, 3 backends on 65537 slots, ~" in warnings[0]
    assert "HPCLB_MAGLEV_LIB" in warnings[0]
    refused = [line for line in out if line.startswith("REFUSED")]
    assert len(refused) == 1, out
    assert "pool web, 1000 backends on 1048573 slots" in refused[0]
    assert f"over the {PYTHON_FILL_MAX_S:g} s allowed" in refused[0]
    assert "HPCLB_MAGLEV_LIB" in refused[0]
