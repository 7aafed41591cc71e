"""An import of a lazarus module inside a function says why it is there.

docs/architecture.md, "Code layers": imports go at the top of a module; one that hides in a
function does so for a reason (the rank side imports without torch until it runs, the CLI
starts without loading what a subcommand needs, the zygote imports torch only once its
environment is set), and that reason is written next to it. The comment is on the import's
own line (any line of it), or on the line directly above it or above the first of the run of
consecutive import lines it stands in (a blank line ends a run). A bare `# noqa` or
`# type: ignore` is not a reason.

Scanned: every module under lazarus/, daemon/, agent/ and trainer/ but trainer/examples/ (the
generated stubs live in proto/, which is not scanned).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("lazarus", "daemon", "agent", "trainer")
SKIPPED = ("trainer/examples",)
RULE = ('an import of a lazarus module inside a function carries a comment saying why it is '
        'not at the top of its module (on its line, or on the line above it or above its run '
        'of imports); the rule is in docs/architecture.md, "Code layers"')

# Tool directives, not reasons: what is left after them must say something.
DIRECTIVE = re.compile(r"(noqa\b(:\s*[A-Z]+[0-9]*(\s*,\s*[A-Z]+[0-9]*)*)?"
                       r"|type:\s*ignore(\[[^\]]*\])?|pragma:\s*no\s*cover|pylint:\s*\S+)",
                       re.I)


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Line -> the comment on it that names something; and the lines that hold only a comment."""
    said, alone = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if not tok.line[:tok.start[1]].strip():
            alone.add(line)
        text = DIRECTIVE.sub("", tok.string.lstrip("#"))
        if re.search(r"[A-Za-z]", text):
            said[line] = tok.string
    return said, alone


def _is_lazarus(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "lazarus" or a.name.startswith("lazarus.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        return node.level > 0 or mod == "lazarus" or mod.startswith("lazarus.")
    return False


def _runs(body: list[ast.stmt]):
    """The runs of consecutive import statements in one body, each on the line after the last."""
    run: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if run and stmt.lineno != run[-1].end_lineno + 1:
                yield run
                run = []
            run.append(stmt)
        else:
            if run:
                yield run
            run = []
    if run:
        yield run


def _bodies(node: ast.AST, in_function: bool):
    """(body, in a function?) for every statement list under node."""
    inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    for field in ("body", "orelse", "finalbody"):
        body = getattr(node, field, None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            yield body, inside
    for handler in getattr(node, "handlers", ()):
        yield from _bodies(handler, inside)
    for case in getattr(node, "cases", ()):
        yield from _bodies(case, inside)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
            yield from _bodies(child, inside)


def unexplained(source: str, name: str = "<source>") -> list[str]:
    """`name:line: import ...` for each in-function lazarus import without a reason beside it."""
    tree = ast.parse(source, name)
    said, alone = _comments(source)
    lines = source.splitlines()
    out = []
    for body, in_function in _bodies(tree, False):
        if not in_function:
            continue
        for run in _runs(body):
            above = run[0].lineno - 1
            covered = above in alone and above in said
            for stmt in run:
                if not _is_lazarus(stmt) or covered:
                    continue
                if any(n in said for n in range(stmt.lineno, stmt.end_lineno + 1)):
                    continue
                out.append(f"{name}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}")
    return out


def _modules():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not any(rel.startswith(skip + "/") for skip in SKIPPED):
                yield rel, path


def test_in_function_lazarus_imports_say_why():
    found = []
    for rel, path in _modules():
        found += unexplained(path.read_text(), rel)
    found.sort(key=lambda f: (f.split(":")[0], int(f.split(":")[1])))
    assert not found, f"{RULE}; these do not:\n  " + "\n  ".join(found)


def test_the_check_refuses_a_silent_import():
    source = '''
from typing import TYPE_CHECKING

import lazarus.core.records  # the top of a module needs no reason

if TYPE_CHECKING:
    from lazarus.core import jobspec

def silent():
    import lazarus.core.contract
    return lazarus.core.contract

def only_noqa():
    from lazarus.core import records  # noqa: F401

def nested():
    class Inner:
        def method(self):
            if True:
                from lazarus.trainer import (
                    hooks,
                )
                return hooks
    return Inner

def relative():
    from . import sibling
    return sibling

def said_on_its_line():
    from lazarus.core import records  # here: the rank side runs without torch
    return records

def said_inside_its_parentheses():
    from lazarus.core.records import (  # here: a fork child imports after it forks
        Node,
    )
    return Node

def said_above_a_run():
    x = 1
    # lazily: only the rare path loads torch
    import os
    from lazarus.core import records
    import lazarus.core.contract
    return x, os, records

def said_above_another_run():
    # lazily: only the rare path loads torch
    import torch

    from lazarus.core import records
    return torch, records

def noqa_above():
    # noqa
    from lazarus.core import contract
    return contract
'''
    found = unexplained(source, "mod.py")
    assert [f.split(": ", 1)[0] for f in found] == [
        "mod.py:10", "mod.py:14", "mod.py:20", "mod.py:27", "mod.py:52", "mod.py:57"], found
    assert found[0] == "mod.py:10: import lazarus.core.contract"
