"""``python -m hpclb.provision``: see :mod:`hpclb.provision.cli`."""

import sys

from hpclb.provision.cli import main

sys.exit(main())
