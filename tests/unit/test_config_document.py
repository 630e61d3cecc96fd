"""ConfigDocument: the configuration file as the REST API edits it.

On every example of appliance/examples: an edit changes only the lines of
the object it edits (the rest of the file, comments and layout, byte for
byte), a put then a delete gives the original text back, and a refused edit
raises EditError of the right kind and leaves the text as it was.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpclb.config import ConfigDocument, EditError, parse_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "appliance" / "examples")
                  .glob("*.yaml"))


def example_params() -> list[Any]:
    return [pytest.param(p, id=p.stem) for p in EXAMPLES]


def lost_lines(before: str, after: str) -> set[int]:
    """The 0-based lines of ``before`` that ``after`` does not keep as they were."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    lost: set[int] = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            lost.update(range(i1, i2))
    return lost


def _item_lines(doc: ConfigDocument, seq: Any, idx: int, text: str) -> set[int]:
    """The lines of item ``idx`` of ``seq``: from its first line to the next
    item's (or the next top-level key's, or the end)."""
    start = seq.lc.item(idx)[0]
    if idx + 1 < len(seq):
        end = seq.lc.item(idx + 1)[0]
    else:
        later = [doc.root.lc.key(k)[0] for k in doc.root if doc.root.lc.key(k)[0] > start]
        pools = doc.root.get("pools") or {}
        later += [pools.lc.key(k)[0] for k in pools if pools.lc.key(k)[0] > start]
        end = min(later, default=len(text.splitlines()))
    return set(range(start, end))


def _first_pool(doc: ConfigDocument) -> str:
    return next(name for name, p in doc.root["pools"].items() if p.get("backends"))


Edit = tuple[str, Callable[[ConfigDocument], None], Callable[[ConfigDocument, str], set[int]]]


def _edits(doc: ConfigDocument) -> list[Edit]:
    """(what, edit, the original lines it may change) for one example."""
    pool = _first_pool(doc)
    backends = doc.root["pools"][pool]["backends"]
    vips = doc.root["vips"]
    first_vip = {k: v for k, v in vips[0].items() if k != "name"}
    last = len(vips) - 1
    return [
        ("add a backend", lambda d: d.put_backend(pool, "zz9", {"address": "10.9.9.9"}),
         lambda d, t: _item_lines(d, d.root["pools"][pool]["backends"], len(backends) - 1, t)),
        ("add a VIP", lambda d: d.put_vip("zz-vip", {"address": "198.18.1.99", "port": 81,
                                                      "pool": pool}),
         lambda d, t: _item_lines(d, d.root["vips"], last, t)),
        ("add a pool", lambda d: d.put_pool("zzpool", {"weights": "static"}),
         lambda d, t: set()),
        ("drain a backend", lambda d: d.set_backend_state(str(backends[0]["name"]), "draining"),
         lambda d, t: _item_lines(d, d.root["pools"][pool]["backends"], 0, t)),
        ("change a VIP's port", lambda d: d.put_vip(str(vips[0]["name"]),
                                                    {**first_vip, "port": 65000}),
         lambda d, t: _item_lines(d, d.root["vips"], 0, t)),
        ("delete the last VIP", lambda d: d.delete_vip(str(vips[last]["name"])),
         lambda d, t: _item_lines(d, d.root["vips"], last, t)
         | _item_lines(d, d.root["vips"], max(0, last - 1), t)),
        # The last one: deleting an earlier one is request #5 (its own test below).
        ("delete a backend", lambda d: d.delete_backend(pool, str(backends[-1]["name"])),
         lambda d, t: _item_lines(d, d.root["pools"][pool]["backends"], len(backends) - 1, t)
         | _item_lines(d, d.root["pools"][pool]["backends"], max(0, len(backends) - 2), t)),
    ]


@pytest.mark.parametrize("example", example_params())
def test_unedited_documents_come_back_byte_for_byte(example: Path) -> None:
    text = example.read_text()
    assert ConfigDocument.parse(text, str(example)).text() == text


@pytest.mark.parametrize("example", example_params())
def test_each_edit_changes_only_the_lines_of_what_it_edits(example: Path) -> None:
    text = example.read_text()
    comments = [line[line.index("#"):] for line in text.splitlines() if "#" in line]
    for what, edit, allowed in _edits(ConfigDocument.parse(text, str(example))):
        doc = ConfigDocument.parse(text, str(example))
        may_change = allowed(doc, text)
        edit(doc)
        edited = doc.text()
        assert edited != text, what
        lost = lost_lines(text, edited) - may_change
        lines = text.splitlines()
        assert not lost, (what, [lines[i] for i in sorted(lost)])
        for comment in comments:  # even on the edited lines
            assert comment.strip() in edited or what.startswith("delete"), (what, comment)
        # Still the same YAML around the edit: the loader reads the result.
        assert isinstance(yaml.safe_load(edited), dict), what


@pytest.mark.parametrize("example", example_params())
def test_put_then_delete_gives_the_original_text_back(example: Path) -> None:
    text = example.read_text()
    first = ConfigDocument.parse(text, str(example))
    pool = _first_pool(first)
    backend = str(first.root["pools"][pool]["backends"][0]["name"])
    state = first.root["pools"][pool]["backends"][0].get("state", "up")
    trips = [
        (lambda d: d.put_backend(pool, "zz9", {"address": "10.9.9.9", "weight": 2}),
         lambda d: d.delete_backend(pool, "zz9")),
        (lambda d: d.put_vip("zz-vip", {"address": "198.18.1.99", "port": 81, "pool": pool}),
         lambda d: d.delete_vip("zz-vip")),
        (lambda d: d.put_pool("zzpool", {"weights": "static"}),
         lambda d: d.delete_pool("zzpool")),
        (lambda d: d.set_backend_state(backend, "down"),
         lambda d: d.set_backend_state(backend, state)),
    ]
    for put, delete in trips:
        doc = ConfigDocument.parse(text, str(example))
        put(doc)
        # The API reparses the file between two writes: both ways must hold.
        reparsed = ConfigDocument.parse(doc.text(), str(example))
        delete(doc)
        delete(reparsed)
        assert doc.text() == text and reparsed.text() == text


def test_an_edit_gives_a_configuration_the_loader_accepts() -> None:
    example = next(p for p in EXAMPLES if p.stem == "lab")
    doc = ConfigDocument.parse(example.read_text(), str(example))
    doc.set_backend_state("b2", "draining")
    doc.put_backend("web", "b4", {"address": "198.18.0.14", "weight": 3})
    doc.put_vip("web-alt", {"address": "198.18.1.11", "port": 8081, "pool": "web"})
    cfg = parse_config(doc.text(), "lab.yaml")
    web = {b.name: b for b in cfg.pools["web"].backends}
    assert web["b2"].state.value == "draining" and web["b4"].weight == 3
    assert [v.name for v in cfg.vips] == ["web", "web-udp", "web-alt"]


LAB = next(p for p in EXAMPLES if p.stem == "lab").read_text()


@pytest.mark.parametrize(("edit", "kind", "says"), [
    (lambda d: d.delete_vip("nope"), "not_found", "no VIP 'nope'"),
    (lambda d: d.delete_pool("nope"), "not_found", "no pool 'nope'"),
    (lambda d: d.delete_backend("web", "nope"), "not_found", "no backend 'nope'"),
    (lambda d: d.put_backend("nope", "b9", {"address": "10.0.0.9"}), "not_found",
     "no pool 'nope'"),
    (lambda d: d.set_backend_state("nope", "down"), "not_found", "no backend 'nope'"),
    (lambda d: d.put_backend("other", "b1", {"address": "10.0.0.9"}), "conflict",
     "in pool 'web'"),
    (lambda d: d.delete_pool("web"), "conflict", "web, web-udp"),
    (lambda d: d.set_backend_state("b1", "sideways"), "invalid", "state must be one of"),
    (lambda d: d.put_vip("x", {"name": "y", "port": 1}), "invalid", "the name is the path's"),
    (lambda d: d.put_pool("x", ["not", "a", "mapping"]), "invalid", "object of fields"),
])
def test_refused_edits_raise_their_kind_and_leave_the_text_unchanged(
        edit: Callable[[ConfigDocument], None], kind: str, says: str) -> None:
    doc = ConfigDocument.parse(LAB, "lab.yaml")
    doc.put_pool("other", {"backends": []})
    before = doc.text()
    with pytest.raises(EditError) as refused:
        edit(doc)
    assert refused.value.kind == kind and says in refused.value.message, refused.value.message
    assert doc.text() == before


@pytest.mark.parametrize("text", ["appliance: [unclosed\n", "- 1\n- 2\n", "just words\n",
                                  "pools: {a: 1}\n\tbad: tab\n"])
def test_what_is_not_a_yaml_mapping_is_refused_as_invalid(text: str) -> None:
    with pytest.raises(EditError) as refused:
        ConfigDocument.parse(text, "bad.yaml")
    assert refused.value.kind == "invalid" and "bad.yaml" in refused.value.message


def test_a_section_of_the_wrong_shape_is_refused_as_invalid() -> None:
    doc = ConfigDocument.parse("pools: [1, 2]\nvips: {a: 1}\n")
    before = doc.text()
    for edit in (lambda d: d.put_pool("p", {}), lambda d: d.put_vip("v", {"port": 1})):
        with pytest.raises(EditError) as refused:
            edit(doc)
        assert refused.value.kind == "invalid"
        assert doc.text() == before


def test_strings_yaml_1_1_would_misread_are_quoted() -> None:
    doc = ConfigDocument.parse("pools:\n  p:\n    backends: []\n")
    doc.put_backend("p", "b1", {"address": "10.0.0.1", "mac": "10:20:30:40:50:59",
                                "via": "on"})
    backend = yaml.safe_load(doc.text())["pools"]["p"]["backends"][0]  # the loader's YAML
    assert backend["mac"] == "10:20:30:40:50:59" and backend["via"] == "on"


SMALL = """\
pools:
  web:  # the web nodes
    backends:
      - {name: b1, address: 10.0.0.11}
      - {name: b2, address: 10.0.0.12, weight: 2}   # the bigger one
  spare:
    backends: []

vips:
  - {name: web-tcp, address: 198.18.1.10, port: 80, pool: web}
"""


def edits(text: str, *steps: Callable[[ConfigDocument], None]) -> str:
    """Each step on the text the last one wrote, reparsed, as the API does."""
    for step in steps:
        doc = ConfigDocument.parse(text)
        step(doc)
        text = doc.text()
    return text


def test_a_pool_filled_emptied_and_deleted_keeps_the_blank_line_before_vips() -> None:
    assert edits(SMALL, lambda d: d.put_pool("batch", {"weights": "static"}),
                 lambda d: d.put_backend("batch", "b9", {"address": "10.0.0.19"}),
                 lambda d: d.delete_backend("batch", "b9"),
                 lambda d: d.delete_pool("batch")) == SMALL


def test_a_state_set_and_unset_keeps_the_comment_on_its_line() -> None:
    """Draining b2 lengthens its line past its comment's column, which moves the
    comment right; undraining leaves it there (the file no longer says where it
    was): b2's line keeps its fields and comment, every other line is as it was."""
    drained = edits(SMALL, lambda d: d.set_backend_state("b2", "draining"))
    assert "weight: 2, state: draining} # the bigger one" in drained
    back = edits(drained, lambda d: d.set_backend_state("b2", "up"))
    changed = [(a, b) for a, b in zip(SMALL.splitlines(), back.splitlines(), strict=True)
               if a != b]
    assert [b.split() for _, b in changed] == [
        "- {name: b2, address: 10.0.0.12, weight: 2} # the bigger one".split()]


def test_deleting_the_first_backend_keeps_the_others_lines() -> None:
    assert edits(SMALL, lambda d: d.delete_backend("web", "b1")) == SMALL.replace(
        "      - {name: b1, address: 10.0.0.11}\n", "")


def test_a_new_pool_takes_a_backend_in_the_same_document() -> None:
    doc = ConfigDocument.parse(SMALL)
    doc.put_pool("batch", {})
    doc.put_backend("batch", "b9", {"address": "10.0.0.19"})
    assert "b9" in doc.text()
