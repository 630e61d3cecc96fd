"""The YAML loader of the configuration: errors name file, line and field.

    cfg = load_config("appliance/examples/lab.yaml")   # raises ConfigError
    cfg.appliance.hash_key_bytes, cfg.pools["web"].backends[0].address, ...

A ConfigError's str() is one line per problem, sorted by position:
``lab.yaml:14:11: vips[0].port: Input should be less than or equal to 65535 (got 70000)``.
A file over MAX_CONFIG_BYTES is refused before it is parsed. libyaml parses when
PyYAML has it (its pure-Python parser takes seconds for 4,096 backends); YAML
errors are reported by the pure-Python parser, so messages never depend on it.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hpclb.config.schema import (
    ApplianceConfig,
    BackendConfig,
    ConnTimeouts,
    HpclbConfig,
    InterfacesConfig,
    Loc,
    NatConfig,
    PoolConfig,
    PortRange,
    SnatConfig,
    VipConfig,
    XdpConfig,
    _Problems,
    loc_path,
)
from hpclb.config.tunnel import TunnelConfig


@dataclass(frozen=True)
class ConfigIssue:
    source: str
    line: int | None  # 1-based
    column: int | None  # 1-based
    path: str  # "vips[0].port", "" for the document or the YAML syntax
    message: str

    def __str__(self) -> str:
        where = self.source + "".join(f":{n}" for n in (self.line, self.column) if n is not None)
        return "".join(f"{part}: " for part in (where, self.path) if part) + self.message


class ConfigError(Exception):
    """A configuration that cannot be used; str() is one line per problem (`issues`)."""

    def __init__(self, issues: list[ConfigIssue] | str) -> None:
        if isinstance(issues, str):  # a plain message from elsewhere (CLI, REST)
            issues = [ConfigIssue("", None, None, "", issues)]
        self.issues = sorted(issues, key=lambda i: (i.line or 0, i.column or 0))
        super().__init__("\n".join(map(str, self.issues)))


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# The largest configuration accepted, in bytes, checked before any parsing. 4,096
# backends (the data planes' limit) take about 340 kB written one per line with
# name, address, weight and MAC, and under 1 MB spelt out in block style with
# every field and a comment each: 4 MiB (1 KiB per backend) leaves that room
# several times over, while a file far beyond any valid configuration is refused
# at once instead of costing its parse (a 5 MB file took 40 s and 0.5 GB).
MAX_CONFIG_BYTES = 4 << 20


def _too_large(source: str, size: int | None) -> ConfigError:
    got = f"{size} bytes, " if size is not None else ""
    msg = (f"configuration too large: {got}over the limit of {MAX_CONFIG_BYTES} bytes "
           f"({MAX_CONFIG_BYTES >> 20} MiB)")
    return ConfigError([ConfigIssue(source, None, None, "", msg)])


class _Constructing(yaml.constructor.SafeConstructor):
    """The construction both loaders share (PyYAML's SafeConstructor, made strict)."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # PyYAML's constructors raise anything on e.g. `!!int abc`
            problem = f"cannot read {_short(node.value)} as {node.tag}: {str(exc)[:200]}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from exc

    def construct_yaml_timestamp(self, node: yaml.Node) -> Any:  # type: ignore[override]
        return self.construct_scalar(node)  # no dates in this schema; keep the text


class _Loader(_Constructing, yaml.SafeLoader):
    """The pure-Python loader: the reference, whose YAML error messages are reported."""


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_timestamp)

_FastLoader: type[_Constructing] | None = None
if getattr(yaml, "__with_libyaml__", False):

    class _CLoader(_Constructing, yaml.CSafeLoader):
        """libyaml's parser and composer (same nodes, same marks, ten times faster);
        any YAML error it finds is reported by _Loader instead, so messages stay the same."""

    _CLoader.add_constructor("tag:yaml.org,2002:timestamp", _CLoader.construct_yaml_timestamp)
    _FastLoader = _CLoader

_MERGE = "tag:yaml.org,2002:merge"
_MODELS = (HpclbConfig, ApplianceConfig, InterfacesConfig, XdpConfig, PoolConfig, BackendConfig,
           NatConfig, SnatConfig, PortRange, ConnTimeouts, TunnelConfig)
_KNOWN_KEYS = sorted({key for model in (*_MODELS, VipConfig) for key in model.model_fields})


def _duplicate_keys(root: yaml.Node, source: str) -> list[ConfigIssue]:
    """A mapping key given twice (YAML would silently keep the last value).

    Run before construction, which rewrites mappings that use merge keys (`<<`).
    Only collections are walked (scalars cannot hold keys), each node once:
    aliases share nodes, which also stops cycles.
    """
    issues: list[ConfigIssue] = []
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], yaml.Node]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                if not isinstance(item, yaml.ScalarNode):
                    stack.append(((*path, str(i)), item))
        elif isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == _MERGE:
                    continue
                if (k.tag, k.value) in keys:
                    m = k.start_mark
                    where = loc_path(tuple(int(p) if p.isdigit() else p for p in (*path, k.value)))
                    issues.append(
                        ConfigIssue(source, m.line + 1, m.column + 1, where, "duplicate key")
                    )
                keys.add((k.tag, k.value))
                if not isinstance(v, yaml.ScalarNode):
                    stack.append(((*path, str(k.value)), v))
    return issues


class _Marks:
    """Where a path (as strings) is in the document, found only when a problem is
    reported: the value's mark for a scalar, else its key's or item's; the nearest
    enclosing one for a path the document does not spell (a missing key)."""

    def __init__(self, root: yaml.Node) -> None:
        self.root = root
        self._keys: dict[int, dict[str, tuple[yaml.Node, yaml.Node]]] = {}

    def _entries(self, node: yaml.MappingNode) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        entries = self._keys.get(id(node))
        if entries is None:  # the last of duplicate keys wins, as in construction
            entries = {str(k.value): (k, v) for k, v in node.value
                       if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE}
            self._keys[id(node)] = entries
        return entries

    def __getitem__(self, path: tuple[str, ...]) -> yaml.Mark:
        node, mark = self.root, self.root.start_mark
        for part in path:
            if isinstance(node, yaml.SequenceNode):
                if not part.isdigit() or int(part) >= len(node.value):
                    break
                node = node.value[int(part)]
                mark = node.start_mark
            elif isinstance(node, yaml.MappingNode):
                entry = self._entries(node).get(part)
                if entry is None:
                    break
                key, node = entry
                mark = (node if isinstance(node, yaml.ScalarNode) else key).start_mark
            else:
                break
        return mark


def _issue(err: dict[str, Any], prefix: Loc, marks: _Marks, source: str) -> ConfigIssue:
    loc: Loc = (*prefix, *(p for p in err["loc"] if p != "[key]"))
    if "[key]" in err["loc"]:  # a bad mapping key: show it as a key even when YAML made it an int
        loc = tuple(map(str, loc))
    mark = marks[tuple(str(p) for p in loc)]
    msg = re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    inp = err.get("input", ...)  # absent for missing keys and cross-field problems
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
        close = difflib.get_close_matches(str(loc[-1]), _KNOWN_KEYS, n=1)
        msg += f" (did you mean {close[0]!r}?)" if close else ""
    elif isinstance(inp, str | int | float | bool | None) and str(inp) not in msg:
        msg += f" (got {_short(inp)})"
    return ConfigIssue(source, mark.line + 1, mark.column + 1, loc_path(loc) or "(top level)", msg)


def _read(loader_class: type[_Constructing], text: str,
          source: str) -> tuple[yaml.Node | None, Any, list[ConfigIssue]]:
    """(root node, constructed data, duplicate-key issues); YAML errors propagate."""
    loader = loader_class(text)  # type: ignore[call-arg]
    try:
        root = loader.get_single_node()  # type: ignore[attr-defined]
        if root is None:
            return None, None, []
        issues = _duplicate_keys(root, source)  # before construction, which merges `<<` keys
        return root, loader.construct_document(root), issues
    finally:
        loader.dispose()  # type: ignore[attr-defined]


def _read_reference(text: str, source: str) -> tuple[yaml.Node | None, Any, list[ConfigIssue]]:
    """_read with the pure-Python loader; its YAML errors become a ConfigError."""
    try:
        return _read(_Loader, text, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        msg = "; ".join(str(s) for s in (exc.context, exc.problem) if s) or "invalid YAML"
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError([ConfigIssue(source, line, col, "", msg)]) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        ch = exc.character
        msg = f"unacceptable character #x{ord(ch) if isinstance(ch, str) else ch:04x}"
        raise ConfigError([ConfigIssue(source, line, None, "", msg)]) from None
    except (yaml.YAMLError, RecursionError) as exc:
        msg = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError([ConfigIssue(source, None, None, "", msg)]) from None


def parse_config(text: str, source_name: str = "<config>") -> HpclbConfig:
    """Parse and validate YAML text; `source_name` prefixes every error line."""
    if len(text) > MAX_CONFIG_BYTES // 4:  # 4 bytes a character at most: count only then
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_CONFIG_BYTES:
            raise _too_large(source_name, size)
    with _gc_paused():
        return _parse(text, source_name)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a document's tens of thousands of nodes
    and objects are made: it would scan them again and again (a quarter of the
    time). Collection resumes at the end and finds any cycle (a recursive alias)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse(text: str, source_name: str) -> HpclbConfig:
    parsed = None
    # libyaml takes tabs where PyYAML refuses them (`port: 80<TAB># x`): a text
    # with a tab is judged by the reference loader alone, so that whether a file
    # loads never depends on whether libyaml is installed.
    if _FastLoader is not None and "\t" not in text:
        try:
            parsed = _read(_FastLoader, text, source_name)
        except MemoryError:
            raise
        except Exception:  # whatever libyaml refused, the reference loader reports it
            parsed = None
    root, data, issues = parsed if parsed is not None else _read_reference(text, source_name)
    if root is None:
        raise ConfigError([ConfigIssue(source_name, 1, None, "", "configuration is empty")])
    marks = _Marks(root)
    try:
        cfg = HpclbConfig.model_validate(data)
        if not issues:
            return cfg
    except ValidationError as exc:
        for err in exc.errors():
            problems = err.get("ctx", {}).get("error")
            if isinstance(problems, _Problems):
                for loc, msg in problems.problems:
                    sub = {"loc": loc, "msg": msg, "type": "cross"}
                    issues.append(_issue(sub, tuple(err["loc"]), marks, source_name))
            else:
                issues.append(_issue(err, (), marks, source_name))
    except RecursionError:
        issues.append(ConfigIssue(source_name, None, None, "", "nesting too deep"))
    raise ConfigError(issues)


def load_config(path: str | Path) -> HpclbConfig:
    """Read and validate a YAML configuration file; any problem raises ConfigError.

    A file larger than MAX_CONFIG_BYTES is refused before it is parsed (and read
    no further than that, whatever it is)."""
    return parse_config(read_config_text(path), str(path))


def read_config_text(path: str | Path) -> str:
    """The text of a configuration file, unparsed (ConfigError when it cannot be
    read or is larger than MAX_CONFIG_BYTES)."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > MAX_CONFIG_BYTES:
                raise _too_large(name, st.st_size)
            text = f.read(MAX_CONFIG_BYTES + 1)  # characters: at least as many bytes
            if len(text) > MAX_CONFIG_BYTES:  # a file that grew, a pipe, a device
                raise _too_large(name, None)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([ConfigIssue(name, None, None, "", f"cannot read: {reason}")]) from None
    return text
