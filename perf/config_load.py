#!/usr/bin/env python3
"""Configuration load: time and peak memory of ``load_config`` on large files.

The code lives in hpclb.lab.control_config_load (shared with `hpclb bench control`, which runs
this measurement beside the others); this script is its stand-alone entry point, with
the same arguments and JSON as before. See that module for what is measured.
"""

from __future__ import annotations

import sys

from hpclb.lab.control_config_load import main

if __name__ == "__main__":
    sys.exit(main())
