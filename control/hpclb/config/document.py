"""The configuration file as a document the REST API edits (ruamel.yaml round-trip).

An edit through the API must survive a restart, so it is written back to the
operator's file; the operator's comments, key order and layout must survive
the edit too. :class:`ConfigDocument` holds the file's round-trip tree and
offers one method per kind of edit. Each either changes the tree or raises
:class:`EditError` with the tree untouched; whether the edited document is a
valid *configuration* is not its business: the controller parses the new text
with the same loader as a start or a SIGHUP reload (``parse_config``) and
prepares it whole before anything is in force.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.tokens import CommentToken

#: The backend states an operator sets (AdminState's values).
ADMIN_STATES = ("up", "draining", "down")


class EditError(Exception):
    """A change refused; ``kind`` says why, as the API's error kinds do:
    not_found, conflict, invalid, precondition_failed, unavailable."""

    def __init__(self, kind: str, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.problems = problems or []


def _yaml(indent: tuple[int, int, int] | None = None) -> YAML:
    """A round-trip YAML; ``indent`` (mapping, sequence, dash offset) as the
    operator's file has it, so an edit does not re-indent the whole file."""
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never fold a long line the operator wrote on one
    if indent is not None:
        y.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    return y


# (mapping, sequence, dash offset) layouts tried, the common ones first.
_LAYOUTS = ((2, 2, 0), (2, 4, 2), (4, 4, 2), (4, 4, 0), (2, 3, 1), (4, 6, 2))


def _dump(root: CommentedMap, indent: tuple[int, int, int]) -> str:
    out = io.StringIO()
    _yaml(indent).dump(root, out)
    return out.getvalue()


def _guess_indent(root: CommentedMap, text: str) -> tuple[int, int, int]:
    """The block layout the file is written in: the first of the usual ones
    that writes the unedited tree back byte for byte, else the one that
    changes the fewest lines."""
    lines = text.splitlines()
    best, best_diff = _LAYOUTS[0], None
    for layout in _LAYOUTS:
        dumped = _dump(root, layout)
        if dumped == text:
            return layout
        diff = sum(a != b for a, b in zip(dumped.splitlines(), lines, strict=False))
        if best_diff is None or diff < best_diff:
            best, best_diff = layout, diff
    return best


def _plain(fields: dict[str, Any], what: str) -> dict[str, Any]:
    """A request's fields, checked to be a mapping of names to plain values."""
    if not isinstance(fields, dict):
        raise EditError("invalid", f"{what}: the body must be an object of fields")
    if "name" in fields:
        raise EditError("invalid", f"{what}: the name is the path's, not a field of the body")
    return copy.deepcopy(fields)


def _gap_token(seq: CommentedSeq, idx: int) -> CommentToken | None:
    """The comment token that ends item ``idx`` of ``seq``: ruamel keeps the
    blank lines after an item in it (a flow item's end-of-line comment, or a
    block mapping's last value's)."""
    item = seq[idx]
    if isinstance(item, CommentedMap) and not item.fa.flow_style() and item:
        tokens = item.ca.items.get(list(item)[-1])
        slot = 2
    else:
        tokens = seq.ca.items.get(idx)
        slot = 0
    token = tokens[slot] if tokens and len(tokens) > slot else None
    return token if isinstance(getattr(token, "value", None), str) else None


def _move_gap(seq: CommentedSeq, src: int, dst: int) -> None:
    """Move the blank lines that end item ``src`` to the end of item ``dst``
    (an item appended after the last one, or the new last after a deletion), so
    a list stays one block and the gap after it stays where it was."""
    token = _gap_token(seq, src)
    if token is None:
        return
    text = token.value.rstrip("\n")
    gap = token.value[len(text):]
    if len(gap) < 2:
        return  # no blank line after the item
    token.value = text + "\n" if text.strip() else "\n"
    item = seq[dst]
    if isinstance(item, CommentedMap) and not item.fa.flow_style() and item:
        last_key = list(item)[-1]
        tokens = item.ca.items.setdefault(last_key, [None, None, None, None])
        old = tokens[2]
        tokens[2] = CommentToken((old.value.rstrip("\n") if old else "") + gap,
                                 token.start_mark, None)
    else:
        tokens = seq.ca.items.setdefault(dst, [None, None, None, None])
        old = tokens[0]
        tokens[0] = CommentToken((old.value.rstrip("\n") if old else "") + gap,
                                 token.start_mark, None)


def _append(seq: CommentedSeq, fields: list[tuple[str, Any]]) -> None:
    """Append a mapping after the last item, in the last item's style (flow or
    block), taking over the blank lines that followed it."""
    item = CommentedMap(fields)
    if len(seq) and isinstance(seq[-1], CommentedMap) and seq[-1].fa.flow_style():
        item.fa.set_flow_style()
    seq.append(item)
    if len(seq) > 1:
        _move_gap(seq, len(seq) - 2, len(seq) - 1)


def _delete(seq: CommentedSeq, idx: int) -> None:
    """Delete item ``idx``; a last item's trailing blank lines go to the new last."""
    if idx == len(seq) - 1 and idx > 0:
        _move_gap(seq, idx, idx - 1)
    del seq[idx]
    seq.ca.items.pop(idx, None)
    # Comments of the items after it move up with them.
    for j in sorted(k for k in seq.ca.items if isinstance(k, int) and k > idx):
        seq.ca.items[j - 1] = seq.ca.items.pop(j)


class ConfigDocument:
    """The YAML file's tree; edits keep everything they do not touch."""

    def __init__(self, root: CommentedMap, source: str,
                 indent: tuple[int, int, int] = (2, 2, 0)) -> None:
        self.root = root
        self.source = source
        self.indent = indent

    @classmethod
    def parse(cls, text: str, source: str = "<config>") -> ConfigDocument:
        try:
            root = _yaml().load(text)
        except YAMLError as err:
            raise EditError("invalid", f"{source}: not YAML: {err}") from err
        if root is None:
            root = CommentedMap()
        if not isinstance(root, CommentedMap):
            raise EditError("invalid", f"{source}: the configuration is not a mapping")
        return cls(root, source, _guess_indent(root, text))

    def text(self) -> str:
        return _dump(self.root, self.indent)

    # --- lookups -------------------------------------------------------------

    def _section(self, key: str, kind: type) -> Any:
        node = self.root.get(key)
        if node is None:
            node = self.root[key] = kind()
        if not isinstance(node, kind):
            raise EditError("invalid", f"{self.source}: {key!r} is not a "
                            f"{'list' if kind is CommentedSeq else 'mapping'}")
        return node

    def _vips(self) -> CommentedSeq:
        return self._section("vips", CommentedSeq)

    def _pools(self) -> CommentedMap:
        return self._section("pools", CommentedMap)

    def _vip_index(self, name: str) -> int | None:
        for i, vip in enumerate(self._vips()):
            if isinstance(vip, dict) and vip.get("name") == name:
                return i
        return None

    def _pool(self, name: str) -> CommentedMap:
        pool = self._pools().get(name)
        if pool is None:
            raise EditError("not_found", f"no pool {name!r}")
        if not isinstance(pool, CommentedMap):
            raise EditError("invalid", f"pools.{name} is not a mapping")
        return pool

    def _backends(self, pool_name: str) -> CommentedSeq:
        pool = self._pool(pool_name)
        backends = pool.get("backends")
        if backends is None:
            backends = pool["backends"] = CommentedSeq()
        if not isinstance(backends, CommentedSeq):
            raise EditError("invalid", f"pools.{pool_name}.backends is not a list")
        return backends

    def backend_pool(self, name: str) -> str | None:
        """The pool holding backend ``name``, or None."""
        for pool_name, pool in self._pools().items():
            backends = pool.get("backends") if isinstance(pool, dict) else None
            for b in backends or ():
                if isinstance(b, dict) and b.get("name") == name:
                    return str(pool_name)
        return None

    # --- edits ---------------------------------------------------------------

    def _atomic(self, edit: Callable[[], None]) -> None:
        """Run ``edit``; if it raises, put the tree back as it was."""
        saved = copy.deepcopy(self.root)
        try:
            edit()
        except BaseException:
            self.root = saved
            raise

    @staticmethod
    def _replace(node: CommentedMap, fields: dict[str, Any], keep: tuple[str, ...]) -> None:
        """``node`` becomes ``fields`` (plus the ``keep`` keys it had), in place, so
        the comments on the keys that stay stay with them."""
        for key in [k for k in node if k not in fields and k not in keep]:
            del node[key]
        for key, value in fields.items():
            node[key] = value

    def put_vip(self, name: str, fields: dict[str, Any]) -> None:
        body = _plain(fields, f"VIP {name!r}")

        def edit() -> None:
            vips = self._vips()
            i = self._vip_index(name)
            if i is None:
                _append(vips, [("name", name), *body.items()])
            else:
                self._replace(vips[i], body, keep=("name",))
        self._atomic(edit)

    def delete_vip(self, name: str) -> None:
        i = self._vip_index(name)
        if i is None:
            raise EditError("not_found", f"no VIP {name!r}")
        _delete(self._vips(), i)

    def put_pool(self, name: str, fields: dict[str, Any]) -> None:
        body = _plain(fields, f"pool {name!r}")

        def edit() -> None:
            pools = self._pools()
            pool = pools.get(name)
            if pool is None:
                body.setdefault("backends", [])
                pools[name] = CommentedMap(body.items())
            else:
                if not isinstance(pool, CommentedMap):
                    raise EditError("invalid", f"pools.{name} is not a mapping")
                # No "backends" in the body: the pool's settings change, its
                # members stay (they have their own endpoint).
                keep = () if "backends" in body else ("backends",)
                self._replace(pool, body, keep=keep)
        self._atomic(edit)

    def delete_pool(self, name: str) -> None:
        self._pool(name)
        users = [str(v.get("name")) for v in self._vips()
                 if isinstance(v, dict) and v.get("pool") == name]
        if users:
            raise EditError("conflict", f"pool {name!r} is used by VIP(s) {', '.join(users)}: "
                            "delete or move them first")
        del self._pools()[name]

    def put_backend(self, pool_name: str, name: str, fields: dict[str, Any]) -> None:
        body = _plain(fields, f"backend {name!r}")
        elsewhere = self.backend_pool(name)
        if elsewhere is not None and elsewhere != pool_name:
            raise EditError("conflict", f"backend {name!r} is in pool {elsewhere!r}: a name "
                            "is one backend; delete it there first")

        def edit() -> None:
            backends = self._backends(pool_name)
            for b in backends:
                if isinstance(b, CommentedMap) and b.get("name") == name:
                    self._replace(b, body, keep=("name",))
                    return
            _append(backends, [("name", name), *body.items()])
        self._atomic(edit)

    def delete_backend(self, pool_name: str, name: str) -> None:
        backends = self._backends(pool_name)
        for i, b in enumerate(backends):
            if isinstance(b, dict) and b.get("name") == name:
                _delete(backends, i)
                return
        raise EditError("not_found", f"no backend {name!r} in pool {pool_name!r}")

    def set_backend_state(self, name: str, state: str) -> None:
        """The operator's state of backend ``name`` (drain, undrain, admin down/up).
        "up" is the default: the key is removed rather than written."""
        if state not in ADMIN_STATES:
            raise EditError("invalid", f"state must be one of {', '.join(ADMIN_STATES)}")
        pool_name = self.backend_pool(name)
        if pool_name is None:
            raise EditError("not_found", f"no backend {name!r}")
        for b in self._backends(pool_name):
            if isinstance(b, CommentedMap) and b.get("name") == name:
                if state == "up":
                    b.pop("state", None)
                else:
                    b["state"] = state
                return
