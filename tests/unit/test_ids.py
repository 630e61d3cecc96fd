"""Backend/VIP ids: stable across restarts, quarantined before reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.controller.ids import Checkpoint, IdTable


def test_ids_are_stable_and_a_freed_id_is_not_handed_straight_out() -> None:
    ids = IdTable(limit=4)
    assert [ids.get(n) for n in ("a", "b", "c")] == [0, 1, 2]
    ids.retain({"a", "c"})          # b leaves: id 1 goes into quarantine
    assert ids.get("d") == 3        # a never-used id first
    assert ids.get("a") == 0 and ids.get("c") == 2
    ids.retain({"a", "c", "d"})
    assert ids.get("e") == 1        # only now, when nothing fresh is left
    with pytest.raises(ValueError, match="no free id"):
        ids.get("f")


def test_checkpoint_round_trip_keeps_ids_and_quarantine(tmp_path: Path) -> None:
    path = tmp_path / "ids.json"
    cp = Checkpoint.load(path, max_backends=8, max_vips=2)
    cp.backends.get("node1")
    cp.backends.get("node2")
    cp.backends.retain({"node2"})
    cp.vips.get("web")
    cp.save()
    again = Checkpoint.load(path, max_backends=8, max_vips=2)
    assert again.backends.ids == {"node2": 1} and again.backends.retired == [0]
    assert again.vips.ids == {"web": 0}
    assert again.backends.get("node3") == 2


def test_unreadable_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "ids.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable checkpoint"):
        Checkpoint.load(path, max_backends=8, max_vips=2)
