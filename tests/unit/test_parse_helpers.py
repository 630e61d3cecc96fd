"""The packet code both data planes share (dataplane/common/lb_parse.h and
lb_rewrite.h), through tests/unit/parse_selftest.c: every truncation point of
every header, bad IHL and total lengths, fragments, VLAN tags, IPv6 extension
chains, the MAC rewrite, and the RFC 1624 checksum update against a full
recomputation.

Built natively with -Wall -Wextra -Werror under ASan/UBSan, and run again
under valgrind; as root, the same file is also compiled with clang -target bpf
(the way dataplane/Makefile compiles lb.bpf.c), loaded (the verifier must
accept the whole parser, IPv6 walk included) and every frame of the corpus is
run through it with BPF_PROG_TEST_RUN: the BPF build must fill the parse
result byte for byte as the native build does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "dataplane/common"
SOURCE = Path(__file__).with_name("parse_selftest.c")
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-std=gnu11"]


def _cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    return cc


def _build(exe: Path, *extra: str, sanitize: bool) -> None:
    base = [_cc(), "-O1", "-g", *WARNINGS, f"-I{COMMON}", "-o", str(exe), str(SOURCE)]
    if sanitize:
        build = subprocess.run(
            [*base, "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", *extra],
            capture_output=True, text=True, check=False)
        if build.returncode == 0:
            return
        # No sanitizer runtime: still worth running plain (but a real
        # compile error must show, so fall through to the plain build).
    build = subprocess.run([*base, *extra], capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr


def _run(argv: list[str]) -> str:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-20000:]
    assert "parse_selftest: ok" in run.stdout, run.stdout[-20000:]
    return run.stdout


def test_parse_and_rewrite_helpers(tmp_path: Path) -> None:
    exe = tmp_path / "parse_selftest"
    _build(exe, sanitize=True)
    out = _run([str(exe)])
    m = re.search(r"parse_selftest: (\d+) frames", out)
    assert m is not None and int(m.group(1)) > 3000, out


def test_parse_helpers_under_valgrind(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("needs valgrind")
    exe = tmp_path / "parse_selftest"
    _build(exe, sanitize=False)
    _run(["valgrind", "--quiet", "--error-exitcode=99", "--leak-check=full",
          "--errors-for-leak-kinds=all", str(exe)])


def test_bpf_build_of_the_parser_agrees_with_the_native_one(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: loading a BPF program, BPF_PROG_TEST_RUN")
    clang = shutil.which("clang")
    if clang is None or not Path("/usr/include/bpf/libbpf.h").exists():
        pytest.skip("needs clang and libbpf-dev")
    machine = subprocess.run([_cc(), "-dumpmachine"], capture_output=True, text=True,
                             check=True).stdout.strip()
    obj = tmp_path / "parse_selftest.bpf.o"
    # The flags dataplane/Makefile gives lb.bpf.c (BPF_CFLAGS).
    build = subprocess.run(
        [clang, "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", "-D__BPF__",
         f"-I{COMMON}", f"-I/usr/include/{machine}", "-c", str(SOURCE), "-o", str(obj)],
        capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr
    exe = tmp_path / "parse_selftest"
    _build(exe, "-DPARSE_SELFTEST_BPF", "-lbpf", sanitize=True)
    out = _run([str(exe), "--bpf", str(obj)])
    m = re.search(r"\((\d+) also through BPF\)", out)
    assert m is not None and int(m.group(1)) > 3000, out
