"""The ``autoshard`` command line (also ``python -m autoshard``).

    autoshard calibrate --out cpu.json     # measure this machine, write a device profile
"""
from __future__ import annotations

import argparse
from typing import Sequence

from . import calibrate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    calibrate.add_arguments(commands.add_parser("calibrate", help="measure this machine and write a device profile (.json)"))
    args = parser.parse_args(argv)
    return {"calibrate": calibrate.run}[args.command](args)

