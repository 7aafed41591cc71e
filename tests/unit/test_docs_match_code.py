"""The docs name the code as it is: README.md's "Layout" names every module of the code's
folders and nothing else, and docs/architecture.md lists exactly the actions the daemon's and
the agent's policies may return. Both drifted once (a module moved, new modules and actions
never listed), so they are checked here the way tests/e2e/test_readme.py checks README's
sample output.

README's Layout is a list with a bullet per folder: the folder first, in backticks, then its
modules in backticks, without `.py` (`- `agent/` the node agent: `service` its loop, ...`). A
backtick span that is a bare name is a module; one with a `/` or a `.` is a file or a path, and
is not checked. docs/architecture.md lists actions under a bullet `**Actions** (`MODULE`)`,
one sub-bullet each, the class name first in backticks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# The folders that hold the code: every package under them must have its bullet in Layout.
CODE_ROOTS = ("lazarus", "daemon", "agent", "trainer", "proto")
# Not described module by module: the generated gRPC stubs (proto/generate.py makes them).
NOT_LISTED = ("proto/lazarus",)

SPAN = re.compile(r"`([^`]+)`")
MODULE = re.compile(r"^[a-z_][a-z0-9_]*$")


# -- README's Layout -----------------------------------------------------------------------------
def _section(text: str, heading: str) -> str:
    """The body of a `## heading` section, up to the next `## `."""
    parts = re.split(rf"^## {re.escape(heading)}\s*$", text, maxsplit=1, flags=re.M)
    assert len(parts) == 2, f"README.md has no '## {heading}' section"
    return re.split(r"^## ", parts[1], maxsplit=1, flags=re.M)[0]


def layout(text: str | None = None) -> dict[str, list[str]]:
    """README's Layout: folder ("agent/", "lazarus/core/") -> the modules its bullet names."""
    items, current = [], None
    for line in _section(README.read_text() if text is None else text, "Layout").splitlines():
        if line.startswith("- "):
            current = [line[2:]]
            items.append(current)
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    out: dict[str, list[str]] = {}
    for item in items:
        spans = SPAN.findall(" ".join(item))
        assert spans and spans[0].endswith("/"), (
            f"README.md's Layout: a bullet that does not start with its folder in backticks "
            f"(`agent/`): {item[0]!r}")
        folder = spans[0]
        assert folder not in out, f"README.md's Layout has two bullets for {folder}"
        out[folder] = [s for s in spans[1:] if MODULE.match(s)]
    return out


def code_folders() -> dict[str, list[str]]:
    """Every package folder of the code -> its modules (less __init__)."""
    out = {}
    for root in CODE_ROOTS:
        for init in sorted((ROOT / root).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT).as_posix()
            if any(folder == n or folder.startswith(n + "/") for n in NOT_LISTED):
                continue
            out[folder + "/"] = sorted(p.stem for p in init.parent.glob("*.py")
                                       if p.name != "__init__.py")
    return out


def test_readme_layout_names_every_module_and_only_those():
    listed, code = layout(), code_folders()
    problems = []
    for folder, modules in sorted(code.items()):
        if folder not in listed:
            problems.append(f"{folder} ({len(modules)} modules) has no bullet in README.md's "
                            f"Layout")
            continue
        unnamed = sorted(set(modules) - set(listed[folder]))
        if unnamed:
            problems.append(f"README.md's Layout, {folder}: lacks "
                            + ", ".join(f"`{m}` ({folder}{m}.py)" for m in unnamed))
        gone = sorted(set(listed[folder]) - set(modules))
        if gone:
            problems.append(f"README.md's Layout, {folder}: names "
                            + ", ".join(f"`{m}`" for m in gone)
                            + f", which is no module of {folder} (no {folder}{gone[0]}.py)")
    for folder in sorted(set(listed) - set(code)):
        if listed[folder] and not (ROOT / folder).is_dir():
            problems.append(f"README.md's Layout names {folder}, which does not exist")
        elif listed[folder]:
            problems.append(f"README.md's Layout names modules of {folder} "
                            f"({', '.join(listed[folder])}), which is no package of the code "
                            f"({' '.join(r + '/' for r in CODE_ROOTS)})")
    assert not problems, "\n".join(problems)


def test_layout_parser_reads_folders_modules_and_continuations():
    text = ("# x\n\n## Layout\n\nOne `lazarus` distribution.\n\n"
            "- `agent/` the agent: `service` its loop, `decide`\n"
            "  (pure); `lazarus/v1/x.proto` is a path, `a.py` a file.\n"
            "- `deploy/` `setup-local.sh`\n\n## Next\n\n- `trainer/` `train`\n")
    assert layout(text) == {"agent/": ["service", "decide"], "deploy/": []}


# -- docs/architecture.md's action lists ---------------------------------------------------------
def documented_actions(module: str) -> list[str]:
    """The class names listed under `- **Actions** (`MODULE`)` in docs/architecture.md."""
    lines = ARCHITECTURE.read_text().splitlines()
    marker = f"**Actions** (`{module}`)"
    starts = [i for i, line in enumerate(lines) if marker in line]
    assert len(starts) == 1, (f"docs/architecture.md: expected one list headed {marker}, "
                              f"found {len(starts)}")
    start = starts[0]
    indent = len(lines[start]) - len(lines[start].lstrip())
    names = []
    for line in lines[start + 1:]:
        if not line.strip() or len(line) - len(line.lstrip()) <= indent:
            break  # the list ends at a blank line or the next bullet of its level
        m = re.match(r"\s*- `([A-Za-z_]\w*)`", line)
        if m:
            names.append(m[1])
    return names


def _dataclasses(path: Path) -> list[ast.ClassDef]:
    tree = ast.parse(path.read_text())

    def is_dataclass(node: ast.ClassDef) -> bool:
        for d in node.decorator_list:
            f = d.func if isinstance(d, ast.Call) else d
            if (isinstance(f, ast.Name) and f.id == "dataclass") or (
                    isinstance(f, ast.Attribute) and f.attr == "dataclass"):
                return True
        return False

    return [n for n in tree.body if isinstance(n, ast.ClassDef) and is_dataclass(n)]


def daemon_actions() -> list[str]:
    """Every dataclass of daemon/actions.py but `Decision`, the envelope that carries them."""
    return [c.name for c in _dataclasses(ROOT / "daemon" / "actions.py") if c.name != "Decision"]


def agent_actions() -> list[str]:
    """The dataclasses of agent/decide.py that its own functions construct: the actions. Its
    other dataclasses (`Local`) are what the loop observes, built by the agent."""
    path = ROOT / "agent" / "decide.py"
    built = {n.func.id for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return [c.name for c in _dataclasses(path) if c.name in built]


def _compare(module: str, code: list[str]) -> list[str]:
    documented = documented_actions(module)
    problems = []
    missing = [a for a in code if a not in documented]
    if missing:
        problems.append(f"docs/architecture.md's **Actions** (`{module}`) lacks "
                        f"{', '.join(missing)}, which {module} defines: add a line for each")
    extra = [a for a in documented if a not in code]
    if extra:
        problems.append(f"docs/architecture.md's **Actions** (`{module}`) lists "
                        f"{', '.join(extra)}, which {module} does not define as an action")
    twice = sorted({a for a in documented if documented.count(a) > 1})
    if twice:
        problems.append(f"docs/architecture.md's **Actions** (`{module}`) lists "
                        f"{', '.join(twice)} twice")
    return problems


def test_architecture_lists_the_daemons_actions():
    code = daemon_actions()
    assert "StartRound" in code and "AdoptClaim" in code, code  # the reader finds them
    problems = _compare("daemon/actions.py", code)
    assert not problems, "\n".join(problems)


def test_architecture_lists_the_agents_actions():
    code = agent_actions()
    assert "Launch" in code and "Local" not in code, code
    problems = _compare("agent/decide.py", code)
    assert not problems, "\n".join(problems)
