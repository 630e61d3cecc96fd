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
import re
from dataclasses import dataclass
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark, YAMLError
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


@dataclass(frozen=True)
class Layout:
    """How the operator's file is written: block indentation (mapping,
    sequence, dash offset) and how it spells an empty value (``null`` or
    nothing), so that an edit rewrites only the lines it changes."""

    mapping: int = 2
    sequence: int = 2
    offset: int = 0
    null: str = ""


def _yaml11_misreads(value: str) -> bool:
    """Whether the loader (PyYAML, YAML 1.1) would read plain ``value`` as
    something other than a string: a MAC of digits (sexagesimal), ``on``..."""
    return _YAML11.resolve(yaml.ScalarNode, value, (True, False)) != "tag:yaml.org,2002:str"


_YAML11 = yaml.resolver.Resolver()


def _yaml(layout: Layout) -> YAML:
    """A round-trip YAML writing as ``layout``. A new string the loader would
    misread unquoted is quoted (strings already in the file keep their style)."""
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never fold a long line the operator wrote on one
    y.indent(mapping=layout.mapping, sequence=layout.sequence, offset=layout.offset)
    rep = y.representer

    def represent_str(r: Any, data: str) -> Any:
        if data and _yaml11_misreads(data):
            return r.represent_scalar("tag:yaml.org,2002:str", data, style="'")
        return r.represent_str(data)

    rep.add_representer(str, represent_str)
    if layout.null:
        rep.add_representer(type(None), lambda r, _: r.represent_scalar(
            "tag:yaml.org,2002:null", layout.null))
    return y


# (mapping, sequence, dash offset) layouts tried, the common ones first.
_INDENTS = ((2, 2, 0), (2, 4, 2), (4, 4, 2), (4, 4, 0), (2, 3, 1), (4, 6, 2))
_NULL = re.compile(r":[ \t]+(null|~)[ \t]*(#.*)?$", re.MULTILINE)


def _comment_columns(node: Any, out: list[tuple[CommentToken, int]]) -> None:
    """Every comment token under ``node`` with its column as parsed."""
    if isinstance(node, (CommentedMap, CommentedSeq)):
        for tokens in node.ca.items.values():
            for t in tokens or ():
                if isinstance(t, CommentToken):
                    out.append((t, t.column))
        children = node.values() if isinstance(node, CommentedMap) else node
        for child in children:
            _comment_columns(child, out)


def _dump(root: CommentedMap, layout: Layout) -> str:
    # ruamel moves an end-of-line comment's column when its line grows (and
    # keeps the new column): put every column back, so a later edit that
    # shortens the line again (an undrain after a drain) restores the file.
    columns: list[tuple[CommentToken, int]] = []
    _comment_columns(root, columns)
    out = io.StringIO()
    try:
        _yaml(layout).dump(root, out)
    finally:
        for token, column in columns:
            token.column = column
    return out.getvalue()


def _guess_layout(root: CommentedMap, text: str) -> Layout:
    """The layout the file is written in: the first of the usual ones that
    writes the unedited tree back byte for byte, else the one that changes the
    fewest lines."""
    nulls = _NULL.findall(text)
    null = nulls[0][0] if nulls else ""
    lines = text.splitlines()
    best, best_diff = Layout(null=null), None
    for indent in _INDENTS:
        layout = Layout(*indent, null=null)
        dumped = _dump(root, layout)
        if dumped == text:
            return layout
        diff = sum(a != b for a, b in zip(dumped.splitlines(), lines, strict=False))
        if best_diff is None or diff < best_diff:
            best, best_diff = layout, diff
    return best


def _commented(value: Any) -> Any:
    """A request's value as round-trip nodes (lists and mappings of the body
    become CommentedSeq/CommentedMap, so later edits find the types they expect)."""
    if isinstance(value, dict):
        return CommentedMap((k, _commented(v)) for k, v in value.items())
    if isinstance(value, list):
        return CommentedSeq(_commented(v) for v in value)
    return value


def _plain(fields: dict[str, Any], what: str) -> dict[str, Any]:
    """A request's fields, checked to be a mapping of names to plain values."""
    if not isinstance(fields, dict):
        raise EditError("invalid", f"{what}: the body must be an object of fields")
    if "name" in fields:
        raise EditError("invalid", f"{what}: the name is the path's, not a field of the body")
    return {str(k): _commented(copy.deepcopy(v)) for k, v in fields.items()}


# --- the blank lines after a block -------------------------------------------------
#
# ruamel keeps the blank lines that follow a block (a list, a mapping) in the
# comment token of the block's *last* scalar: a flow item's end-of-line comment
# (slot 0 of the sequence's entry), or a mapping value's (slot 2). Appending
# after that item, or deleting it, would leave the gap inside the block or take
# it away: the gap is moved to the new last item instead.


def _last_slot(node: Any) -> tuple[dict[Any, Any], Any, int] | None:
    """(ca.items, key, slot) where the comment ending ``node``'s last line lives."""
    if isinstance(node, CommentedMap) and len(node):
        key = list(node)[-1]
        value = node[key]
        if isinstance(value, (CommentedMap, CommentedSeq)) and not len(value):
            return None  # ruamel keeps what follows an empty [] before the next key
        if isinstance(value, (CommentedMap, CommentedSeq)) and not value.fa.flow_style():
            return _last_slot(value)
        return node.ca.items, key, 2
    if isinstance(node, CommentedSeq) and len(node):
        idx = len(node) - 1
        item = node[idx]
        if isinstance(item, (CommentedMap, CommentedSeq)) and len(item) \
                and not item.fa.flow_style():
            return _last_slot(item)
        return node.ca.items, idx, 0
    return None


def _take_gap(node: Any) -> str:
    """Remove and return the blank lines after ``node``'s last line ("" if none)."""
    where = _last_slot(node)
    if where is None:
        return ""
    items, key, slot = where
    tokens = items.get(key)
    token = tokens[slot] if tokens and len(tokens) > slot else None
    value = getattr(token, "value", None)
    if not isinstance(value, str):
        return ""
    text = value.rstrip("\n")
    gap = value[len(text):]
    if len(gap) < 2 and text:
        return ""  # a comment ends the line; no blank line follows
    if not text:  # the token was only the line end and the blank lines
        gap = value[1:] if value.startswith("\n") else value
        if not gap:
            return ""
        token.value = "\n"
        return gap
    token.value = text + "\n"
    return gap[1:]


def _give_gap(node: Any, gap: str) -> bool:
    """Put ``gap`` (blank lines) after ``node``'s last line; False when
    ``node`` has no place for it (it is empty, or ends with an empty list)."""
    if not gap:
        return True
    where = _last_slot(node)
    if where is None:
        return False
    items, key, slot = where
    tokens = items.setdefault(key, [None, None, None, None])
    while len(tokens) <= slot:
        tokens.append(None)
    old = tokens[slot]
    if isinstance(getattr(old, "value", None), str):
        old.value = old.value.rstrip("\n") + "\n" + gap if old.value.strip() else \
            "\n" + gap
    else:
        tokens[slot] = CommentToken("\n" + gap, CommentMark(0), None)
    return True


def _gap_before(mapping: CommentedMap, key: str, gap: str) -> None:
    """Blank lines before ``key`` of ``mapping`` (a pre-comment of the key: where
    ruamel keeps what follows a block that ends with an empty list)."""
    tokens = mapping.ca.items.setdefault(key, [None, None, None, None])
    before = tokens[1] if isinstance(tokens[1], list) else []
    tokens[1] = [CommentToken(gap, CommentMark(0), None), *before]


def _append(seq: CommentedSeq, fields: list[tuple[str, Any]]) -> None:
    """Append a mapping after the last item, in the last item's style (flow or
    block), taking over the blank lines that followed it."""
    item = CommentedMap(fields)
    if len(seq) and isinstance(seq[-1], CommentedMap) and seq[-1].fa.flow_style():
        item.fa.set_flow_style()
    gap = _take_gap(seq)
    seq.append(item)
    _give_gap(seq, gap)


def _delete(seq: CommentedSeq, idx: int) -> str:
    """Delete item ``idx`` (ruamel moves the later items' comments up); a last
    item's trailing blank lines go to the new last. Returns the blank lines
    that found no place (the list is left empty): the caller places them."""
    gap = _take_gap(seq) if idx == len(seq) - 1 else ""
    del seq[idx]
    return "" if _give_gap(seq, gap) else gap


def _put_key(mapping: CommentedMap, key: str, value: Any) -> str:
    """Add ``key`` at the end of ``mapping``, taking over the blank lines after
    its last entry. Returns the blank lines that found no place."""
    gap = _take_gap(mapping)
    mapping[key] = value
    return "" if _give_gap(mapping, gap) else gap


def _delete_key(mapping: CommentedMap, key: str) -> str:
    """Delete ``key``; its trailing blank lines, when it was the last, go to the
    new last entry. Returns the blank lines that found no place."""
    last = list(mapping)[-1] == key
    gap = _take_gap(mapping) if last else ""
    del mapping[key]
    mapping.ca.items.pop(key, None)
    return "" if _give_gap(mapping, gap) else gap


class ConfigDocument:
    """The YAML file's tree; edits keep everything they do not touch.

    Each edit checks what it needs (the pool exists, the name is free...)
    before it changes anything, so a refused edit leaves the tree as it was
    (save an empty section it may have added). No copy is taken to undo one:
    a deep copy of a 1,000-backend tree costs seconds, and the controller
    drops a document whose change was refused anyway."""

    def __init__(self, root: CommentedMap, source: str,
                 layout: Layout | None = None) -> None:
        self.root = root
        self.source = source
        self.layout = layout or Layout()
        # The text this tree was parsed from or last written as (its owner
        # compares it, by identity, with the text in force before reusing it).
        self.source_text: str | None = None

    @classmethod
    def parse(cls, text: str, source: str = "<config>") -> ConfigDocument:
        try:
            root = _yaml(Layout()).load(text)
        except YAMLError as err:
            raise EditError("invalid", f"{source}: not YAML: {err}") from err
        if root is None:
            root = CommentedMap()
        if not isinstance(root, CommentedMap):
            raise EditError("invalid", f"{source}: the configuration is not a mapping")
        doc = cls(root, source, _guess_layout(root, text))
        doc.source_text = text
        return doc

    def text(self) -> str:
        return _dump(self.root, self.layout)

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

    def _place_gap(self, section: str, gap: str) -> None:
        """Blank lines left over by an edit of ``section``: before the next
        top-level key (or at the end of the section when it is the last)."""
        if not gap:
            return
        keys = list(self.root)
        following = keys[keys.index(section) + 1:] if section in keys else []
        if following:
            _gap_before(self.root, following[0], gap)

    # --- edits ---------------------------------------------------------------

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
        edit()

    def delete_vip(self, name: str) -> None:
        i = self._vip_index(name)
        if i is None:
            raise EditError("not_found", f"no VIP {name!r}")
        self._place_gap("vips", _delete(self._vips(), i))

    def put_pool(self, name: str, fields: dict[str, Any]) -> None:
        body = _plain(fields, f"pool {name!r}")

        def edit() -> None:
            pools = self._pools()
            pool = pools.get(name)
            if pool is None:
                body.setdefault("backends", CommentedSeq())
                self._place_gap("pools", _put_key(pools, name, CommentedMap(body.items())))
            else:
                if not isinstance(pool, CommentedMap):
                    raise EditError("invalid", f"pools.{name} is not a mapping")
                # No "backends" in the body: the pool's settings change, its
                # members stay (they have their own endpoint).
                keep = () if "backends" in body else ("backends",)
                self._replace(pool, body, keep=keep)
        edit()

    def delete_pool(self, name: str) -> None:
        self._pool(name)
        users = [str(v.get("name")) for v in self._vips()
                 if isinstance(v, dict) and v.get("pool") == name]
        if users:
            raise EditError("conflict", f"pool {name!r} is used by VIP(s) {', '.join(users)}: "
                            "delete or move them first")
        self._place_gap("pools", _delete_key(self._pools(), name))

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
        edit()

    def delete_backend(self, pool_name: str, name: str) -> None:
        backends = self._backends(pool_name)
        for i, b in enumerate(backends):
            if isinstance(b, dict) and b.get("name") == name:
                gap = _delete(backends, i)
                if gap and not _give_gap(self._pool(pool_name), gap):
                    self._place_gap("pools", gap)
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
