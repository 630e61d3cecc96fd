"""The reconcile loop: configuration, health and telemetry in, tables out.

Importing the package gives :class:`Controller` and :class:`StartError`.
"""

from __future__ import annotations

from hpclb.controller.core import Controller, StartError

__all__ = ["Controller", "StartError"]
