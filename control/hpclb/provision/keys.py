"""CURVE keys: the control plane's keypair and the exchange with the nodes.

The files are pyzmq certificates, the format ``hpclb-agent keygen`` writes
(``zmq.auth.create_certificates``): ``NAME.key`` holds the public key,
``NAME.key_secret`` both. A keypair is made once and never replaced by
provisioning (the agents trust the public half); only its modes and owners
are kept right. The exchange directory (``--keys-dir``; Vagrant shares
/vagrant/.hpclb-keys) is a real path even under ``--root``: the gateway puts
its ``server.key`` there and takes every other ``NAME.key`` as an agent
allowed to publish.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from hpclb.provision.actions import WriteFile, _lstat, _ownership
from hpclb.provision.plan import Action, BaseAction, Context, ProvisionError
from hpclb.provision.render import ALLOW_DIR, CURVE_DIR

#: A node id as hpclb-agent takes it (its file name is NAME.key).
_KEY_FILE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62})\.key$")


def _keypair(name: str) -> tuple[bytes, bytes]:
    """(public file, secret file) bytes of a fresh certificate pair."""
    with tempfile.TemporaryDirectory() as tmp:
        public, secret = zmq.auth.create_certificates(tmp, name, metadata={"node-id": name})
        return Path(public).read_bytes(), Path(secret).read_bytes()


def public_from_secret(secret: Path, name: str) -> bytes:
    """The public certificate file for an existing secret one (the format
    pyzmq writes, which ``zmq.auth.load_certificate`` reads)."""
    public_key, _ = zmq.auth.load_certificate(secret)
    return (f"#   ****  ZeroMQ CURVE public certificate of {name}, written again from its\n"
            "#   ****  secret key by hpclb provision\n"
            f"metadata\n    node-id = {name}\ncurve\n"
            f"    public-key = \"{public_key.decode()}\"\n").encode()


@dataclass
class CurveKeypair(BaseAction):
    """``DIR/NAME.key`` (0644) and ``DIR/NAME.key_secret`` (``secret_mode``,
    root:``group``) exist. Made when the secret is missing; a missing public
    half is written again from the secret."""

    directory: str = CURVE_DIR
    name: str = "server"
    group: str = "hpclb"
    secret_mode: int = 0o640
    #: A directory that may hold a pair made beforehand (NAME.key and
    #: NAME.key_secret; Vagrant makes them on the host): installed instead of
    #: a fresh pair when the root has none yet.
    seed: Path | None = None

    def _seeded(self) -> tuple[bytes, bytes] | None:
        if self.seed is None:
            return None
        public = self.seed / f"{self.name}.key"
        secret = self.seed / f"{self.name}.key_secret"
        if not secret.is_file():
            return None
        try:
            zmq.auth.load_certificate(secret)
        except (OSError, ValueError) as err:
            raise ProvisionError(f"{secret}: not a CURVE secret key file ({err})") from None
        pub = public.read_bytes() if public.is_file() else public_from_secret(secret, self.name)
        return pub, secret.read_bytes()

    def describe(self) -> str:
        return f"CURVE keypair {self.directory}/{self.name}.key{{,_secret}}"

    def _paths(self) -> tuple[str, str]:
        return f"{self.directory}/{self.name}.key", f"{self.directory}/{self.name}.key_secret"

    def pending(self, ctx: Context) -> list[str]:
        public, secret = self._paths()
        if _lstat(ctx.path(secret)) is None:
            seeded = self.seed is not None and (self.seed / f"{self.name}.key_secret").is_file()
            return [f"install keypair from {self.seed}" if seeded else "create keypair"]
        out = []
        st = _lstat(ctx.path(public))
        if st is None:
            out.append(f"{public}: write from the secret key")
        else:
            out += [f"{public}: {c}" for c in _ownership(ctx, st, 0o644, "root", self.group)]
        st = _lstat(ctx.path(secret))
        out += [f"{secret}: {c}" for c in
                _ownership(ctx, st, self.secret_mode, "root", self.group)]
        return out

    def apply(self, ctx: Context) -> None:
        public, secret = self._paths()
        if _lstat(ctx.path(secret)) is None:
            pub_bytes, sec_bytes = self._seeded() or _keypair(self.name)
        else:
            sec_bytes = ctx.path(secret).read_bytes()
            try:
                pub_bytes = public_from_secret(ctx.path(secret), self.name)
            except (OSError, ValueError) as err:
                raise ProvisionError(f"{ctx.path(secret)}: not a CURVE secret key "
                                     f"file ({err}); move it away to make a new "
                                     "keypair") from None
            if ctx.path(public).exists():
                pub_bytes = ctx.path(public).read_bytes()  # never rewrite a trusted key
        # The secret first, never readable by others even for a moment.
        WriteFile(secret, sec_bytes, self.secret_mode, "root", self.group).apply(ctx)
        WriteFile(public, pub_bytes, 0o644, "root", self.group).apply(ctx)


@dataclass
class ExportFile(BaseAction):
    """A file outside the root (the key exchange directory, a real path)
    holds ``content``; mode 0644 (public keys only)."""

    path: Path = Path()
    source: str = ""  # the root path it comes from, read at apply time

    def describe(self) -> str:
        return f"export {self.source} to {self.path}"

    def pending(self, ctx: Context) -> list[str]:
        src = ctx.path(self.source)
        if not src.exists():
            return ["copy (once it exists)"]
        if not self.path.exists():
            return ["create"]
        return [] if self.path.read_bytes() == src.read_bytes() else ["content"]

    def apply(self, ctx: Context) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.hpclb-new")
        tmp.write_bytes(ctx.path(self.source).read_bytes())
        tmp.chmod(0o644)
        tmp.replace(self.path)


def server_keys(keys_dir: Path | None) -> list[Action]:
    """The gateway's keys: its keypair (the one in ``keys_dir`` when a pair
    was made beforehand), its public key exported to ``keys_dir``, and every
    agent key found there allowed."""
    actions: list[Action] = [CurveKeypair(seed=keys_dir)]
    if keys_dir is None:
        return actions
    actions.append(ExportFile(keys_dir / "server.key", f"{CURVE_DIR}/server.key"))
    for name, content in agent_keys(keys_dir).items():
        actions.append(WriteFile(f"{ALLOW_DIR}/{name}.key", content, 0o644, "root", "hpclb"))
    return actions


def agent_keys(keys_dir: Path) -> dict[str, bytes]:
    """NAME -> public key file of every ``NAME.key`` in ``keys_dir`` but the
    server's own (checked to be a CURVE public key)."""
    out: dict[str, bytes] = {}
    if not keys_dir.is_dir():
        return out
    for path in sorted(keys_dir.iterdir()):
        m = _KEY_FILE.match(path.name)
        if not m or m.group(1) == "server" or not path.is_file():
            continue
        try:
            zmq.auth.load_certificate(path)
        except (OSError, ValueError) as err:
            raise ProvisionError(f"{path}: not a CURVE public key file ({err})") from None
        out[m.group(1)] = path.read_bytes()
    return out
