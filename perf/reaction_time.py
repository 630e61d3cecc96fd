#!/usr/bin/env python3
"""Reaction time: node telemetry received -> ring patch applied in the data plane,
and ring slots a single weight step touches against the minimum.

The code lives in hpclb.lab.control_reaction (shared with `hpclb bench control`, which runs
this measurement beside the others); this script is its stand-alone entry point, with
the same arguments and JSON as before. See that module for what is measured.
"""

from __future__ import annotations

import sys

from hpclb.lab.control_reaction import main

if __name__ == "__main__":
    sys.exit(main())
