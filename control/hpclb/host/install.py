"""Where the data plane's build outputs are: the install manifest.

The control plane runs programs and loads files that the data plane's build
makes: the daemons ``hpclb-xdp`` and ``hpclb-dpdk``, the Maglev fill
``libhpclb_maglev.so``, the BPF objects the lab and the benchmark attach.
:func:`find` is the one place that says where each of them is.

It reads the *install manifest*, ``_installed.json`` in this package's own
folder, which ``make -C dataplane`` (run by ``./bootstrap``) writes: the
absolute path of every output, under whatever ``BUILD=`` folder the build
used. It is generated and ignored by git, like a generated ``_version.py``.
An environment variable per output, where one exists (``HPCLB_XDP_BIN``,
``HPCLB_DPDK_BIN``, ``HPCLB_MAGLEV_LIB``), wins over the manifest when set;
it is taken at its word, so one that names nothing is an error that names the
variable, never a silent fall back to another build.

Why a manifest written by the build, and not:

* a walk up from a module's file to ``dataplane/build``: it holds only for
  one layout of one source tree; a copy of the package elsewhere (a wheel, a
  site-packages install, a ``BUILD=`` folder elsewhere) finds nothing, or an
  old build that happens to sit where the walk lands;
* ``$PATH``: it finds whatever is installed, possibly another release's
  daemon speaking another protocol version;
* a prefix setting (``HPCLB_PREFIX`` with a default such as
  ``/opt/hpclb/libexec``): every process that needs an output (the systemd
  unit, ``sudo``, the tests, the lab's subprocesses) must carry it, and its
  default is wrong for every source tree but one.

The manifest is written by the one step that knows where the outputs were
put, is found from the package itself (no search), and records paths, not
contents: a rebuild needs no new manifest, and a missing output is reported
with its path. The appliance is installed as a tree with ``./bootstrap`` run
in it (``appliance/systemd/hpclb.service``), so its manifest names that
tree's build; a packaging that puts the outputs elsewhere writes a manifest
with those paths (``make -C dataplane manifest BUILD=...`` or by hand: the
format is ``{"format": 1, "outputs": {name: absolute path}}``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

#: Written by ``make -C dataplane`` (dataplane/Makefile, MANIFEST=) into the
#: hpclb package itself, so an installed package carries its own.
MANIFEST = Path(str(files("hpclb"))) / "_installed.json"
MANIFEST_FORMAT = 1
REMEDY = "run ./bootstrap (or make -C dataplane)"


@dataclass(frozen=True)
class Output:
    """One build output: its name in the manifest, the environment variable
    that overrides it (None: none) and whether it must be executable."""

    name: str
    env: str | None = None
    executable: bool = False


#: Every output the control plane, the lab and the benchmark use.
OUTPUTS: dict[str, Output] = {o.name: o for o in (
    Output("hpclb-xdp", "HPCLB_XDP_BIN", executable=True),
    Output("hpclb-dpdk", "HPCLB_DPDK_BIN", executable=True),
    Output("libhpclb_maglev.so", "HPCLB_MAGLEV_LIB"),
    Output("lb.bpf.o"),
    Output("pass.bpf.o"),
    Output("reflect.bpf.o"),
    Output("sink.bpf.o"),
    Output("decap.bpf.o"),
    Output("noop.bpf.o"),
)}


class MissingBuildOutput(FileNotFoundError):
    """A build output is not where the manifest (or its variable) says, or
    there is no manifest; the message says what to run."""


def _usable(path: Path, output: Output) -> bool:
    return path.is_file() and (not output.executable or os.access(path, os.X_OK))


def _what(output: Output) -> str:
    return "an executable file" if output.executable else "a file"


def read_manifest() -> dict[str, str]:
    """The manifest's outputs, name -> absolute path (unchecked)."""
    try:
        data = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        raise MissingBuildOutput(
            f"no install manifest ({MANIFEST}): the data plane was not built; {REMEDY}"
        ) from None
    except (OSError, ValueError) as err:
        raise MissingBuildOutput(f"install manifest {MANIFEST} unreadable ({err}); "
                                 f"{REMEDY}") from err
    if not isinstance(data, dict):
        data = {}
    outputs = data.get("outputs")
    if data.get("format") != MANIFEST_FORMAT or not isinstance(outputs, dict):
        raise MissingBuildOutput(f"install manifest {MANIFEST} is not format "
                                 f"{MANIFEST_FORMAT}; {REMEDY}")
    return {str(k): str(v) for k, v in outputs.items()}


def find(name: str) -> Path:
    """The absolute path of build output ``name`` (a key of :data:`OUTPUTS`).

    Its environment variable when set, else the manifest's entry. Raises
    :class:`MissingBuildOutput` when that names no usable file.
    """
    output = OUTPUTS[name]  # an unknown name is a bug, not a missing build
    override = os.environ.get(output.env) if output.env else None
    if override:
        path = Path(override)
        if not _usable(path, output):
            raise MissingBuildOutput(f"{name}: {output.env}={override} is not {_what(output)}; "
                                     f"unset {output.env} or point it at a build")
        return path
    entry = read_manifest().get(name)
    if entry is None:
        raise MissingBuildOutput(f"{name} is not in the install manifest {MANIFEST} "
                                 f"(built by an older Makefile); {REMEDY}")
    path = Path(entry)
    if not path.is_absolute():
        raise MissingBuildOutput(f"{name}: install manifest {MANIFEST} gives a relative "
                                 f"path {entry}; {REMEDY}")
    if not _usable(path, output):
        raise MissingBuildOutput(f"{name} not built: {path} is not {_what(output)}; {REMEDY}")
    return path
