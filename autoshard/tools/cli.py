"""The ``autoshard`` command line (also ``python -m autoshard``).

    autoshard calibrate --out cpu.json     # measure this machine, write a device profile
    autoshard explain examples/train_gpt.py:build_model --world-size 64 --html out.html
                                           # compile in one process on a fake world, report what the backend did
"""
from __future__ import annotations

import argparse
from typing import Sequence

from autoshard.tools import calibrate
from autoshard.tools.explain import add_arguments as explain_arguments  # autoshard.explain is the function
from autoshard.tools.explain import run as run_explain


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    calibrate.add_arguments(commands.add_parser("calibrate", help="measure this machine and write a device profile (.json)"))
    explain_arguments(commands.add_parser("explain", help="compile a model on a fake world and report what the backend did"))
    args = parser.parse_args(argv)
    return {"calibrate": calibrate.run, "explain": run_explain}[args.command](args)

