"""The ``autoshard`` command line (also ``python -m autoshard``).

    autoshard calibrate --out cpu.json     # measure this machine, write a device profile
    autoshard explain examples/train_gpt.py:build_model --world-size 64 --html out.html
                                           # compile in one process on a fake world, report what the backend did
    autoshard plan examples/train_gpt.py:build_model --world-size 64 --ranks-per-node 8 --memory-budget-gb 40 --json plan.json
                                           # choose the sharding layout (autoshard.shard(model, plan=...) applies it)
    autoshard report run.jsonl --html run.html  # a run measured by autoshard.Telemetry, rank by rank
"""
from __future__ import annotations

import argparse
from typing import Sequence

from autoshard.tools.calibrate import measure as calibrate
from autoshard.tools.explain import add_arguments as explain_arguments  # autoshard.explain is the function
from autoshard.tools.explain import run as run_explain
from autoshard.tools.plan.plan import add_arguments as plan_arguments  # autoshard.plan is the function
from autoshard.tools.plan.plan import run as run_plan
from autoshard.tools.report import run as measured_run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    calibrate.add_arguments(commands.add_parser("calibrate", help="measure this machine and write a device profile (.json)"))
    explain_arguments(commands.add_parser("explain", help="compile a model on a fake world and report what the backend did"))
    plan_arguments(commands.add_parser("plan", help="choose the sharding layout for a world size and memory budget"))
    measured_run.add_arguments(commands.add_parser("report", help="draw a run measured by autoshard.Telemetry as a page"))
    args = parser.parse_args(argv)
    return {"calibrate": calibrate.run, "explain": run_explain, "plan": run_plan, "report": measured_run.run}[args.command](args)

