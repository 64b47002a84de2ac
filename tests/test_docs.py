"""README.md and docs/ against the code they restate, so they cannot drift.

- README stays a front door: at most :data:`MAX_README_LINES` lines.
- README's backend options table lists exactly the fields of
  :class:`autoshard.compiler.options.Options`, and its default column agrees with each field whose
  default is a literal.
- The pipeline picture in README ("How it works") lists the steps of each list declared in
  ``autoshard/compiler/pipeline.py``, in order, and every stage list written as
  ``{captured,joint,...}`` in README or docs/ is :data:`autoshard.compiler.pipeline.STAGES`.
- README's layout table names only files and folders that exist, each in its row's folder, and
  every subpackage (room) of a folder under ``autoshard/``.
- Every relative link in README.md, CHANGELOG.md and docs/*.md points to an existing file, and a
  ``#fragment`` into a Markdown file to one of its headings.

Each check is a function returning its problems; ``test_each_check_can_fail`` feeds each one a
broken copy of the real text, so none of them passes vacuously.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from autoshard.compiler import pipeline
from autoshard.compiler.options import Options

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKDOWN = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

# The lists README's picture draws, by the label that starts each of its groups.
DECLARED = {"CAPTURED": pipeline.CAPTURED, "JOINT": pipeline.JOINT, "PARTITIONED": pipeline.PARTITIONED}

FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.M | re.S)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (each replaced by an empty line)."""
    return FENCE.sub("", text)


def _code_blocks(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


# (b) the options table


def options_rows(text: str) -> list[tuple[str, str]] | None:
    """(option, default cell) of each row of the table whose header is ``| option | default | ...``;
    None when there is no such table."""
    lines = _prose(text).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[:2] == ["option", "default"]:
            rows = []
            for row in lines[i + 2:]:  # after the header's separator
                if not row.startswith("|"):
                    break
                cells = _cells(row)
                rows.append((cells[0].strip("`"), cells[1]))
            return rows
    return None


def _literal(cell: str) -> tuple[bool, object]:
    """(True, value) when ``cell`` is exactly one code span holding a Python literal."""
    m = re.fullmatch(r"`([^`]+)`", cell)
    if not m:
        return False, None
    try:
        return True, ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return False, None


def options_problems(text: str) -> list[str]:
    rows = options_rows(text)
    if rows is None:
        return ["no table with the header '| option | default | ...'"]
    fields = {f.name: f for f in dataclasses.fields(Options)}
    names = [name for name, _ in rows]
    problems = [f"option {n!r} is listed {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    problems += [f"option {n!r} is in the table but not a field of Options" for n in sorted(set(names) - set(fields))]
    problems += [f"field {n!r} of Options is missing from the table" for n in sorted(set(fields) - set(names))]
    for name, cell in rows:
        field = fields.get(name)
        if field is None or field.default is dataclasses.MISSING:  # a default_factory: not a literal
            continue
        default = field.default
        is_literal, value = _literal(cell)
        if default is None:
            if is_literal and value is not None:
                problems.append(f"option {name!r}: the table's default {cell} is not the code's None")
        elif not is_literal or value != default or type(value) is not type(default):
            problems.append(f"option {name!r}: the table's default {cell!r} is not the code's {default!r}")
    return problems


# (c) the pipeline picture and the stage lists


def _steps(steps) -> list[str]:
    return [f"[{s.name}]" if isinstance(s, pipeline.Stage) else s.name for s in steps]


def _drawn(steps) -> list[str]:
    """What a picture must draw: every stage and every pass a reader sees (one with words for
    the report); passes that change nothing a reader sees may be left out (a new one then
    needs no edit here)."""
    return [f"[{s.name}]" if isinstance(s, pipeline.Stage) else s.name for s in steps if isinstance(s, pipeline.Stage) or s.what]


def _in_order(drawn: list[str], declared: list[str]) -> bool:
    """``drawn`` holds every step it must, each declared, in the declared order."""
    rest = iter(declared)
    return all(step in rest for step in drawn)


def pipeline_picture(text: str) -> dict[str, list[str]] | None:
    """The groups of the code block drawing the pipeline: a line starting with a label in
    :data:`DECLARED` opens a group, indented lines continue it; each group's steps are its
    pass names and its ``[stage]`` names, in order. None when no block draws it."""
    for block in _code_blocks(text):
        groups: dict[str, list[str]] = {}
        label = None
        for line in block.splitlines()[1:-1]:
            m = re.match(r"([A-Z]+)\s+(.*)", line)
            if m and m.group(1) in DECLARED:
                label, line = m.group(1), m.group(2)
                groups[label] = []
            elif label is None or not line[:1].isspace():
                label = None
                continue
            groups[label] += [stage or name for stage, name in re.findall(r"(\[[^\]]+\])|([A-Za-z_]\w*)", line)]
        if {"JOINT", "PARTITIONED"} <= set(groups):
            return groups
    return None


def pipeline_problems(text: str) -> list[str]:
    groups = pipeline_picture(text)
    if groups is None:
        return ["no code block draws the pipeline (lines starting JOINT and PARTITIONED)"]
    problems = [f"the picture draws {label}, which pipeline.py does not declare" for label in groups if label not in DECLARED]
    for label, steps in DECLARED.items():
        if label not in groups:
            problems.append(f"the picture lacks {label}: {' → '.join(_steps(steps))}")
        elif not (_in_order(groups[label], _steps(steps)) and set(_drawn(steps)) <= set(groups[label])):
            problems.append(f"the picture's {label} is {' → '.join(groups[label])}; pipeline.py declares {' → '.join(_steps(steps))}"
                            f" (a picture must draw at least {' → '.join(_drawn(steps))}, in that order)")
    return problems


def stage_lists(text: str) -> list[list[str]]:
    """Every ``{a,b,c}`` list of which at least three items are stage names."""
    found = [m.group(1).split(",") for m in re.finditer(r"\{(\w+(?:,\w+)+)\}", text)]
    return [items for items in found if len(set(items) & set(pipeline.STAGES)) >= 3]


def stage_list_problems(text: str) -> list[str]:
    return [f"stage list {{{','.join(items)}}} is not pipeline.STAGES {{{','.join(pipeline.STAGES)}}}"
            for items in stage_lists(text) if tuple(items) != pipeline.STAGES]


# (e) the layout table


def layout_rows(text: str) -> dict[str, str]:
    """folder -> its ``what`` cell, from the table whose header is ``| folder | what |``."""
    lines = _prose(text).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[:2] == ["folder", "what"]:
            rows = {}
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                folder, what = _cells(row)[:2]
                rows[re.match(r"`([^`]+)`", folder).group(1)] = what
            return rows
    return {}


def layout_problems(text: str, root: Path = ROOT) -> list[str]:
    rows = layout_rows(text)
    if not rows:
        return ["no table with the header '| folder | what |'"]
    problems = []
    for folder, what in rows.items():
        named = re.findall(r"`([\w./]+(?:\.py|/))`", what)
        # a name with a slash is under the folder; a bare file may sit in the room named before it
        rooms = [""]
        for name in named:
            if name.endswith("/"):
                rooms = ["", name]
            if not any((root / folder / room / name).exists() for room in rooms):
                problems.append(f"layout table: {folder}{name} does not exist")
        if folder.startswith("autoshard/"):
            for sub in sorted(p.name for p in (root / folder).iterdir() if (p / "__init__.py").exists()):
                if f"`{sub}/`" not in what:
                    problems.append(f"layout table: the room {folder}{sub}/ is not named in its row")
    return problems


# (d) links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _prose(text), re.M):
        slug = _slug(m.group(1))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``'s prose (not in code)."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    return [m.group(1) for m in LINK.finditer(prose)]


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for target in links(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{path.name}: link to {target!r}: no such file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text() if file else text):
            problems.append(f"{path.name}: link to {target!r}: {dest.name} has no heading with that anchor")
    return problems


# The tests


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {MAX_README_LINES})"


def test_options_table_lists_the_options_dataclass():
    assert options_problems(README.read_text()) == []


def test_pipeline_picture_matches_the_declared_pipeline():
    assert pipeline_problems(README.read_text()) == []


def test_stage_lists_are_the_declared_stages():
    assert stage_lists(README.read_text()), "README's debug_dir row should list the stages as {captured,...}"
    for path in MARKDOWN:
        assert stage_list_problems(path.read_text()) == [], path


def test_layout_table_matches_the_tree():
    assert layout_problems(README.read_text()) == []


def test_relative_links_point_to_existing_files():
    problems = [p for path in MARKDOWN for p in link_problems(path, path.read_text())]
    assert problems == []


def test_each_check_can_fail():
    readme = README.read_text()
    # (a)
    assert len((readme + "\n" * MAX_README_LINES).splitlines()) > MAX_README_LINES
    # (b) an option the code lacks, one it has dropped, a changed literal default
    row = next(line for line in readme.splitlines() if line.startswith("| `optimizer_states` |"))
    assert any("fake_option" in p for p in options_problems(readme.replace(row, row + "\n| `fake_option` | `1` | no |")))
    assert any("missing" in p for p in options_problems(readme.replace(row + "\n", "")))
    assert any("optimizer_states" in p for p in options_problems(readme.replace(row, row.replace("| `2` |", "| `3` |"))))
    assert any("compiler" in p for p in options_problems(readme.replace('| `compiler` | `"inductor"` |', '| `compiler` | `"eager"` |')))
    # (c) a pass the report describes left out, two swapped, a stage list out of order
    assert pipeline_problems(readme.replace(" → normalize_collectives", ""))  # a pass the report describes
    assert not pipeline_problems(readme.replace(" → check_ranks_agree", ""))  # one it does not: may be left out
    assert pipeline_problems(readme.replace("merge_shared_parameters → lower_annotations", "lower_annotations → merge_shared_parameters"))
    assert stage_list_problems(readme.replace("{captured,joint,", "{joint,captured,"))
    # (e) a file the tree lacks, a room left out
    assert any("report/nowhere.py" in p for p in layout_problems(readme.replace("`report/`", "`report/` `report/nowhere.py`")))
    assert any("room" in p for p in layout_problems(readme.replace("`calibrate/`", "calibrate")))
    # (d) a file that is not there, an anchor that is not there
    assert link_problems(README, readme + "\n[gone](docs/no-such-page.md)\n")
    assert link_problems(README, readme + "\n[gone](docs/design.md#no-such-heading)\n")
    assert link_problems(README, readme + "\n[gone](#no-such-heading)\n")
