"""The `hpclb` command: the appliance's commands (:mod:`hpclb.faces.cli`)
and, beside them, the lab's (:mod:`hpclb.lab.commands`). The one module above
every floor, so the appliance's own code never imports the lab.
"""

from __future__ import annotations

import sys

from hpclb.faces import cli
from hpclb.lab.commands import add_lab_commands


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, extra_commands=(add_lab_commands,))


if __name__ == "__main__":
    sys.exit(main())
