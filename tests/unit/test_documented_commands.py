"""Every command and option the docs tell a user to type is run by a test, the way it is typed.

The documented commands are read from README.md and docs/operations.md: backtick spans in
tables and prose, and the lines of fenced code blocks, that start with `lazarus NAME` or
`.venv/bin/lazarus NAME` (NAME in lazarus.cli.COMMANDS); in a table cell, spans that go on
with such a list without the prefix (`lazarus status`, `nodes`, `events [--follow]`); and the
rows of a table with a "flag" column (the daemon's and agent's flags: the "process" column
names the command, "both" is both; elsewhere the command last named above the table). An
option is a `--flag` of the span, line or row; a documented choice `--flag a|b` is an entry
per choice (`--etcd HOST:PORT|embedded`: `--etcd` and `--etcd embedded`).

tests/documented_commands.toml maps each entry ("daemon", "daemon --job", "etcd certs --host")
to the tests that run it: `python -m lazarus.cli ...`, the `lazarus` entry point, or the
command's main(argv). Checked here: every documented flag exists in the command's --help,
every entry has tests, the tests exist and their source (the module, the conftest.py files
above it, the tests.* modules it imports, and what types the commands for it: the local
cluster, the deploy files) names the command, the option and a way into the CLI, and no entry
outlives its documentation. The --help of every command is read once, in one process.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from lazarus.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/operations.md")
MAPPING = ROOT / "tests" / "documented_commands.toml"

# What types our commands for a test, besides the test itself: LocalCluster spawns `python -m
# lazarus.cli daemon ...` and `... agent ...` with its flags (for a test that imports it); the
# systemd test runs the units' ExecStart lines (for a test whose module names their dir).
IMPORTED = {"lazarus.sim.localcluster": [ROOT / "lazarus" / "sim" / "localcluster.py"]}
NAMED = {'"deploy" / "systemd"': [ROOT / "deploy" / "systemd" / f"lazarus-{p}.service"
                                  for p in ("daemon", "agent")]}

PREFIX = re.compile(r"^(?:\.venv/bin/)?lazarus\s+(\S+)(.*)$")
SPAN = re.compile(r"`([^`]+)`")
# A flag's value never starts with "-": in `--nodes --spares` both are flags (a value there
# once hid every other option of a list from this check).
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)(?:[ =]([^\s\[\]-][^\s\[\]]*))?")
CHOICE = re.compile(r"^[a-z][a-z0-9-]*$")   # a literal value, not a placeholder like HOST:PORT


@dataclass(frozen=True, slots=True)
class Doc:
    """One documented command (`option` None) or option, and where the docs say it."""
    command: str          # "daemon", "etcd certs", "checkpoint now"
    option: str | None    # "--job", "--etcd embedded"
    where: str            # "README.md:142"
    text: str             # the span, line or row as written

    @property
    def key(self) -> str:
        return self.command if self.option is None else f"{self.command} {self.option}"


# -- what --help says ----------------------------------------------------------------------------
# `lazarus NAME --help` of every command, then `lazarus NAME SUB --help` of each subcommand (the
# choices of a positional `{a,b,c}` in its usage: `etcd certs`, `checkpoint now`), in one
# process: torch is imported once. COLUMNS: no wrapping, one option a line.
_HELP_SCRIPT = r"""
import contextlib, io, json, os, re, sys
os.environ["COLUMNS"] = "10000"
from lazarus import cli

def help_of(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main([*argv, "--help"])
        except SystemExit:
            pass
    return buf.getvalue()

out = {}
for name in cli.COMMANDS:
    out[name] = help_of([name])
    choices = re.search(r"\{([a-z0-9,-]+)\}", out[name].split("\n\n", 1)[0])
    for sub in choices[1].split(",") if choices else []:
        out[f"{name} {sub}"] = help_of([name, sub])
print(json.dumps(out))
"""


@cache
def _helps() -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", _HELP_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def help_text(command: str) -> str:
    """`lazarus COMMAND --help`, COMMAND being "NAME" or "NAME SUB"."""
    return _helps()[command]


def subcommands_of(name: str) -> list[str]:
    return [key.split()[1] for key in _helps() if key.startswith(f"{name} ")]


def accepted_flags(command: str) -> set[str]:
    flags = set()
    for line in help_text(command).splitlines():
        if line.startswith("  -"):  # the option list: "  -h, --help", "  --etcd ETCD"
            flags.update(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", line.split("  ", 2)[1]))
    return flags


# -- what the docs say ---------------------------------------------------------------------------
def _cells(row: str) -> list[str]:
    """A table row's cells; `\\|` stays in its cell as `|`."""
    cells = re.split(r"(?<!\\)\|", row.strip())
    return [c.replace("\\|", "|").strip() for c in cells[1:-1]]


def _command_of(text: str) -> tuple[str, str] | None:
    """(command, the rest) of `lazarus NAME ...`; the subcommand joins the name."""
    m = PREFIX.match(text.strip())
    if not m or m.group(1) not in COMMANDS:
        return None
    return _with_sub(m.group(1), m.group(2))


def _with_sub(name: str, rest: str) -> tuple[str, str]:
    words = rest.split()
    if words and words[0] in subcommands_of(name):
        return f"{name} {words[0]}", " ".join(words[1:])
    return name, rest


def _options(rest: str) -> list[str]:
    """The options of a command's text: `--flag`, or `--flag choice` per literal choice."""
    out = []
    for flag, value in FLAG.findall(rest):
        choices = value.split("|") if value else []
        literal = [c for c in choices if CHOICE.match(c)]
        if len(choices) > 1 and literal:
            out += [f"{flag} {c}" for c in literal]
            if len(literal) < len(choices):
                out.append(flag)
        else:
            out.append(flag)
    return out


def _entries(command: str, rest: str, where: str, text: str) -> list[Doc]:
    rest = re.split(r"(?:^|\s)--(?:\s|$)", rest, maxsplit=1)[0]  # `-- COMMAND ARGS`: the user's
    return [Doc(command, None, where, text)] + [Doc(command, o, where, text)
                                               for o in _options(rest)]


def _code_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A code block's commands: continuation lines joined, comments dropped, `&&` and `;`
    split."""
    out, pending, start = [], "", 0
    for no, line in block:
        line = re.sub(r"(^|\s)#.*$", "", line)
        if not pending:
            start = no
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out += [(start, part) for part in re.split(r"&&|\|\||;", pending + line)]
        pending = ""
    return out


class _Reader:
    """One pass over a Markdown file: prose paragraphs, fenced code blocks and table rows."""

    def __init__(self, name: str):
        self.name = name
        self.docs: list[Doc] = []
        # what a "flag" table without a "process" column is about: the last command named
        self.last_command: str | None = None
        self.para: list[tuple[int, str]] = []
        self.header: list[str] | None = None

    def add(self, found: tuple[str, str], no: int, text: str) -> None:
        self.docs += _entries(*found, f"{self.name}:{no}", text)
        self.last_command = found[0]

    def paragraph(self) -> None:
        """Spans that start with `lazarus NAME`; a span may run across lines. A paragraph
        that starts "Options of `lazarus NAME`:" lists options of that command in the spans
        after it."""
        text = " ".join(line for _, line in self.para)
        ends = [len(" ".join(line for _, line in self.para[:i + 1]))
                for i in range(len(self.para))]
        listing, options_of = text.startswith("Options of "), None
        for m in SPAN.finditer(text):
            no = self.para[next(i for i, end in enumerate(ends) if m.start() < end)][0]
            if found := _command_of(m.group(1)):
                self.add(found, no, m.group(0))
                if listing and options_of is None:
                    options_of = found[0]
            elif options_of is not None:
                self.docs += _entries(options_of, m.group(1), f"{self.name}:{no}",
                                      m.group(0))[1:]
        self.para.clear()

    def code(self, block: list[tuple[int, str]]) -> None:
        for no, command in _code_lines(block):
            if found := _command_of(command):
                self.add(found, no, command.strip())

    def row(self, no: int, line: str) -> None:
        cells = _cells(line)
        if self.header is None:
            self.header = [c.lower() for c in cells]
            return
        if set(line) <= set("|-: "):
            return
        row = dict(zip(self.header, cells))
        if "flag" in row:  # the daemon's and agent's flags, goodput's
            process = row.get("process")
            commands = ((["daemon", "agent"] if process == "both" else [process]) if process
                        else [self.last_command])
            self.docs += [Doc(command, option, f"{self.name}:{no}", f"`{span}`")
                          for command in commands for span in SPAN.findall(row["flag"])
                          for option in _options(span)]
        for cell in cells:
            listing = None  # `lazarus status`, `nodes`, ...: the list goes on without the prefix
            for span in SPAN.findall(cell):
                found = _command_of(span)
                if found:
                    listing = found[0]
                elif listing and span.split()[0] in COMMANDS:
                    found = _with_sub(span.split()[0], span[len(span.split()[0]):])
                if found:
                    self.add(found, no, f"`{span}`")

    def read(self, lines: list[str]) -> list[Doc]:
        fence: list[tuple[int, str]] | None = None
        for no, line in enumerate(lines, 1):
            if line.startswith("```"):
                self.paragraph()
                if fence is not None:
                    self.code(fence)
                fence = [] if fence is None else None
            elif fence is not None:
                fence.append((no, line))
            elif line.startswith("|"):
                self.paragraph()
                self.row(no, line)
            else:
                self.header = None
                if line.strip() and not line.startswith("#"):
                    self.para.append((no, line))
                else:
                    self.paragraph()
        self.paragraph()
        return self.docs


def documented() -> list[Doc]:
    return [d for name in DOCS for d in _Reader(name).read((ROOT / name).read_text().splitlines())]


# -- the mapping ---------------------------------------------------------------------------------
def mapping() -> dict[str, list[str]]:
    return tomllib.loads(MAPPING.read_text())


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


@cache
def sources(test_file: str) -> str:
    """What a test of `test_file` runs of ours to type a command: its module, the conftest.py
    files above it, the tests.* modules it imports (and theirs), and a harness it uses."""
    path = ROOT / test_file
    seen: list[Path] = []
    todo = [path] + [p / "conftest.py" for p in path.parents if ROOT in (p, *p.parents)]
    while todo:
        p = todo.pop()
        if not p.is_file() or p in seen:
            continue
        seen.append(p)
        if p.suffix != ".py":
            continue
        text = p.read_text()
        todo += [f for name, files in NAMED.items() if name in text for f in files]
        for module in _imports(p):
            if module.startswith("tests."):
                todo.append(ROOT / (module.replace(".", "/") + ".py"))
            todo += IMPORTED.get(module, [])
    return "\n".join(p.read_text() for p in seen)


def _has_word(source: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", source) is not None


def _ways_in(command: str) -> tuple[str, ...]:
    module, func, _ = COMMANDS[command.split()[0]]
    return ("lazarus.cli", "bin/lazarus", "cli.main", f"{module} import {func}",
            f"{module.rsplit('.', 1)[1]}.{func}(")


def problems_of_test(doc_key: str, test_id: str) -> str | None:
    file, _, name = test_id.partition("::")
    path = ROOT / file
    if not name or not path.is_file():
        return f"{test_id}: not FILE::TEST_NAME of a file under tests/"
    if not re.search(rf"^\s*def {re.escape(name.split('[')[0])}\(", path.read_text(), re.M):
        return f"{test_id}: no `def {name}` in {file}"
    source = sources(file)
    words = doc_key.split()
    missing = [w for w in words if not _has_word(source, w)]
    if missing:
        return f"{test_id}: its source never names {' '.join(missing)}"
    if not any(way in source for way in _ways_in(doc_key)):
        return f"{test_id}: runs no `lazarus {words[0]}` ({' or '.join(_ways_in(doc_key))})"
    return None


# -- the checks ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return documented()


def test_the_docs_name_commands_and_options(docs):
    """The extraction finds what a reader sees (a sanity check of the parser itself)."""
    keys = {d.key for d in docs}
    for key in ("status", "events --follow", "etcd passwords", "etcd certs --host",
                "checkpoint now", "daemon --etcd embedded", "daemon --job", "agent --tier0 off",
                "goodput --t0-every", "preflight --min-bandwidth", "uncordon", "up",
                "up --chaos", "up --first-step-timeout"):
        assert key in keys, key


def test_train_help_names_the_setting_each_flag_sets():
    """README: `lazarus train --help` names the setting each flag sets (`--ckpt-dir` is
    `checkpoint.dir`)."""
    options = {line.split()[0]: line for line in help_text("train").splitlines()
               if line.startswith("  --")}
    assert options["--ckpt-dir"].endswith("[checkpoint.dir]")
    assert options["--fused-kernels"].endswith("[model.fused_kernels]")


def test_every_documented_flag_is_accepted(docs):
    wrong = [f"{d.where}: `lazarus {d.command}` has no {d.option.split()[0]} (in: {d.text})"
             for d in docs if d.option and d.option.split()[0] not in accepted_flags(d.command)]
    assert not wrong, "documented flags the command does not accept:\n" + "\n".join(wrong)


def test_every_documented_command_and_option_is_run_by_a_test(docs):
    table = mapping()
    first: dict[str, Doc] = {}
    for d in docs:
        first.setdefault(d.key, d)
    problems = []
    for key, d in first.items():
        if key not in table or not table[key]:
            problems.append(f"{d.where} documents `lazarus {key}` (in: {d.text}) and no test "
                            f"runs it: write one that runs `python -m lazarus.cli "
                            f"{key} ...` and asserts what a user sees, and add "
                            f"\"{key}\" = [\"tests/...py::test_name\"] to "
                            f"tests/documented_commands.toml")
            continue
        problems += [p for t in table[key] if (p := problems_of_test(key, t))]
    stale = sorted(set(table) - set(first))
    problems += [f"tests/documented_commands.toml: \"{k}\" is documented no more in "
                 f"{' or '.join(DOCS)}: remove its entry" for k in stale]
    assert not problems, "\n".join(problems)


def test_ci_runs_the_readmes_test_command():
    # CI's promise (.ci/run): README's second command, plus reporting flags only
    root = Path(__file__).resolve().parents[2]
    (readme,) = re.findall(r"^bash deploy/setup-local\.sh && (\.venv/bin/python -m pytest .*)$",
                           (root / "README.md").read_text(), flags=re.M)
    (ci,) = re.findall(r"^(\.venv/bin/python -m pytest .*)$", (root / ".ci" / "run").read_text(),
                       flags=re.M)
    extra = ci.split()
    for arg in readme.split():
        assert arg in extra, f"README's test command has {arg!r}, .ci/run does not: {ci}"
        extra.remove(arg)
    assert set(extra) <= {"-ra", "--durations=0"}, extra
