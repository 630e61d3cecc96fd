"""The `hpclb` command: the appliance's commands (:mod:`hpclb.faces.cli`),
the lab's (:mod:`hpclb.lab.commands`) and host provisioning
(:mod:`hpclb.provision`, also `python -m hpclb.provision`). The one module
above every floor, so the appliance's own code never imports the lab or the
provisioning.
"""

from __future__ import annotations

import argparse
import sys

from hpclb.faces import cli
from hpclb.lab.commands import add_lab_commands
from hpclb.provision import cli as provision_cli


def _add_provision_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Listed in `hpclb --help`; its own parser (hpclb.provision.cli) reads the rest.
    p = sub.add_parser("provision", add_help=False,
                       help="provision this host as a gateway, node or client "
                       "(appliance/provision.sh runs it; `hpclb provision --help`)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: provision_cli.main(a.args))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["provision"]:
        # Straight through: argparse's REMAINDER would swallow the subcommand's
        # own --help and options into the wrong parser.
        return provision_cli.main(args[1:])
    return cli.main(args, extra_commands=(add_lab_commands, _add_provision_command))


if __name__ == "__main__":
    sys.exit(main())
