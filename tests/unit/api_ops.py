"""The Operations interface over a YAML text, for the REST API's unit suites
(the HTTP layer and the CLI over it): edits applied to a real ConfigDocument and
the result validated whole by the real loader, one at a time as the
controller's loop applies them. What it leaves out is the controller's side of
a write (prepare, the file, the data plane), which tests/lab/test_api.py drives
through a real `hpclb run`. Each suite gives its own status snapshot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from hpclb.config import ConfigDocument, ConfigError, EditError, HpclbConfig, parse_config
from hpclb.controller.operations import revision_of


class DocumentOps:
    def __init__(self, text: str) -> None:
        self.lock = threading.Lock()
        self.reset(text)

    def reset(self, text: str) -> None:
        self.text = text
        self.cfg = parse_config(text, "t.yaml")
        self.pins: dict[str, dict[str, float]] = {}
        self.changes = 0

    def revision(self) -> str:
        return revision_of(self.text)

    def config(self) -> HpclbConfig:
        return self.cfg

    def config_text(self) -> str:
        return self.text

    def status(self) -> dict[str, Any] | None:
        raise NotImplementedError  # each suite's snapshot

    def change(self, edit: Callable[[ConfigDocument], None], if_match: str | None = None,
               timeout_s: float = 30.0) -> str:
        with self.lock:
            if if_match not in (None, "*") and if_match != self.revision():
                raise EditError("precondition_failed",
                                f"the configuration is not at revision {if_match}")
            doc = ConfigDocument.parse(self.text, "t.yaml")
            edit(doc)
            text = doc.text()
            try:
                cfg = parse_config(text, "t.yaml")
            except ConfigError as err:
                raise EditError("invalid", "the new configuration is refused",
                                [str(i) for i in err.issues]) from None
            self.text, self.cfg = text, cfg
            self.changes += 1
            return self.revision()

    def pin(self, backend: str, weight: float, duration_s: float) -> None:
        if self.cfg.pool_of(backend) is None:
            raise EditError("not_found", f"no backend {backend!r}")
        self.pins[backend] = {"weight": weight, "until": time.time() + duration_s}

    def unpin(self, backend: str) -> None:
        self.pins.pop(backend, None)
