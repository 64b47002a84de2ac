"""Stage code as the report page shows it: compact (no strides, devices or frees after last
use) and with repeated blocks folded, so a 12-layer model's code is about two layers long.
:meth:`autoshard.tools.report.report.Report.code` and debug_dir keep every line."""
from __future__ import annotations

import re

from torch import fx

from autoshard.cost.liveness import module_path
from autoshard.passes.graph_utils import block_of

MAX_CODE_CHARS = 500_000  # per stage in the page, after folding; an 8B model's joint graph is tens of MB

_DELETES = re.compile(r";  (?:\w+ = )+None$", re.M)  # print_readable's "x = None" frees: noise to a reader
_NODE_LINE = re.compile(r"^        (\w+)(?::| =)")  # a node's definition: "name: ..." or "name = ..."
_RENAMED = re.compile(r"(?<=_)\d+\b")  # view_12 and view_40 are the same op in two blocks
_AC_ID = re.compile(r"# ac_graph_id: \d+")  # a recompute region's id differs per block


def _signature(line: str) -> str:
    return _RENAMED.sub("#", _AC_ID.sub("# ac_graph_id: #", line))


def node_block(node: fx.Node | None) -> str | None:
    """The model block a node comes from (``blocks.3``), else its top-level module; backward
    nodes carry the forward's module stack."""
    path = module_path(node) if node is not None else None
    return (block_of(path + ".x") or path.split(".")[0]) if path else None


def _repeated_blocks(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> its repeated block (``blocks.k``). Nodes traced in no module (bucket
    copy-ins, collectives, copy-outs) join the block that all their users are in, else the
    one all their inputs are in (what follows a reduction)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    block = {n: b for n in nodes if (b := node_block(n)) is not None and block_of(b + ".x")}
    orphans = [n for n in nodes if module_path(n) is None]

    def inherit(node: fx.Node, neighbours: list[fx.Node]) -> None:
        found = {block.get(m) for m in neighbours}
        if node not in block and len(found) == 1 and None not in found:
            block[node] = found.pop()

    for n in reversed(orphans):  # users come later: settled from the end
        inherit(n, list(n.users))
    for n in orphans:  # inputs come earlier: settled from the start
        inherit(n, n.all_input_nodes)
    return {n.name: b for n, b in block.items()}


def fold_blocks(code: str, gm: fx.GraphModule) -> str:
    """Replace the lines of each repeated block (``blocks.k``: every node made in it, with the
    comments above them) whose code equals an earlier block's up to node names by one comment
    naming that block. Lines of other nodes (collectives, copy-outs) stay where they are."""
    repeated = _repeated_blocks(gm)
    lines = code.split("\n")
    owner: list[str | None] = [None] * len(lines)
    pending: list[int] = []  # comments and blank lines go with the node line after them
    for i, line in enumerate(lines):
        match = _NODE_LINE.match(line)
        if match is None:
            if not line.strip() or line.strip().startswith("#"):
                pending.append(i)
            else:
                pending = []
            continue
        block = repeated.get(match.group(1))
        for j in pending + [i]:
            owner[j] = block
        pending = []
    members: dict[str, list[int]] = {}
    for i, block in enumerate(owner):
        if block is not None:
            members.setdefault(block, []).append(i)
    first_with: dict[tuple[str, ...], str] = {}
    replaced: dict[int, str] = {}
    dropped: set[int] = set()
    for block, where in members.items():
        signature = tuple(_signature(lines[i]) for i in where if lines[i].strip())  # blank lines fall where they fall
        same = first_with.setdefault(signature, block)
        if same != block:
            count = sum(1 for i in where if _NODE_LINE.match(lines[i]))
            replaced[where[0]] = f"        # {block}: {count} nodes, the same code as {same} up to names (folded in this page)"
            dropped.update(where[1:])
    return "\n".join(replaced.get(i, line) for i, line in enumerate(lines) if i not in dropped)


def page_code(gm: fx.GraphModule, stage: str) -> str:
    """``gm`` as the page shows it: compact, repeated blocks folded, cut at ``MAX_CODE_CHARS``."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    code = _DELETES.sub("", code).replace("        # No stacktrace found for following nodes\n", "")
    code = fold_blocks(code, gm)
    if len(code) > MAX_CODE_CHARS:
        code = code[:MAX_CODE_CHARS] + (
            f"\n# ... truncated ({len(code):,} characters); Report.code({stage!r}) or debug_dir has it all\n")
    return code
