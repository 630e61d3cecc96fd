#!/usr/bin/env python3
"""Probe scale: N endpoints on loopback at a fixed interval, the prober on one core.

The code lives in hpclb.lab.control_probes (shared with `hpclb bench control`, which runs
this measurement beside the others); this script is its stand-alone entry point, with
the same arguments and JSON as before. See that module for what is measured.
"""

from __future__ import annotations

import sys

from hpclb.lab.control_probes import main

if __name__ == "__main__":
    sys.exit(main())
