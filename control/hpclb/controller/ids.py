"""Stable table ids, checkpointed to disk.

A pinned flow remembers a backend *id*; if a restart of the control plane gave
that id to another node, established flows would silently land on the wrong
machine. Ids are therefore allocated once per name and written to a JSON
checkpoint (atomically: write, fsync, rename) that every later run reloads.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from hpclb.host.files import write_atomically


@dataclass
class IdTable:
    """name -> small integer.

    A freed id goes to the back of a quarantine queue and is handed out again
    only when no never-used id is left, oldest first: a flow still pinned to a
    removed backend's id must not land on whichever node is added next.
    """

    limit: int
    ids: dict[str, int] = field(default_factory=dict)
    retired: list[int] = field(default_factory=list)

    def get(self, name: str) -> int:
        if name not in self.ids:
            taken = set(self.ids.values()) | set(self.retired)
            free = next((i for i in range(self.limit) if i not in taken), None)
            if free is None:
                if not self.retired:
                    raise ValueError(f"no free id for {name!r}: all {self.limit} are in use")
                free = self.retired.pop(0)
            self.ids[name] = free
        return self.ids[name]

    def retain(self, names: set[str]) -> None:
        """Forget names no longer configured; their ids go into quarantine."""
        for name, i in list(self.ids.items()):
            if name not in names:
                del self.ids[name]
                self.retired.append(i)


@dataclass
class Checkpoint:
    path: Path
    backends: IdTable
    vips: IdTable
    # What the file holds as far as this process knows: a push that changes no
    # id touches no file (and works while the process is out of descriptors).
    _saved: str | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path, max_backends: int, max_vips: int) -> Checkpoint:
        data: dict[str, dict[str, int]] = {}
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable checkpoint ({exc}); move it away") from exc
        return cls(
            path,
            IdTable(max_backends, dict(data.get("backends", {})),
                    list(data.get("retired_backends", []))),
            IdTable(max_vips, dict(data.get("vips", {})), list(data.get("retired_vips", []))),
        )

    def save(self) -> None:
        """Write the checkpoint, unless it already holds exactly this."""
        payload = json.dumps({
            "backends": self.backends.ids, "vips": self.vips.ids,
            "retired_backends": self.backends.retired, "retired_vips": self.vips.retired,
        }, indent=1)
        if payload == self._saved:
            return
        with contextlib.suppress(OSError):
            if self.path.read_text() == payload:
                self._saved = payload
                return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, payload.encode(), 0o600)
        self._saved = payload
