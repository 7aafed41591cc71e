"""`python -m lazarus.cli ARGV` for many command lines at once, each in a process of its own --
its exit code and all it writes on stderr, however written -- forked from one that has
imported the CLI's modules: a fresh interpreter and `import torch` per case took 2 s each.
For the tables of bad command lines, which must fail before any work starts."""

from __future__ import annotations

import json
import subprocess
import sys

_FORKED = r"""
import importlib, json, os, sys, tempfile, traceback
from lazarus import cli
for module, _func, _ in cli.COMMANDS.values():
    importlib.import_module(module)
out = []
for argv in json.loads(sys.stdin.read()):
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(err.fileno(), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code or 0)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    out.append({"code": os.waitstatus_to_exitcode(status),
                "stderr": err.read().decode(errors="replace")})
print(json.dumps(out))
"""




def run_cli_forked(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """What `lazarus ARGV` did for each ARGV of `argvs`, in order (stdout is not kept)."""
    proc = subprocess.run([sys.executable, "-c", _FORKED], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess(argv, r["code"], "", r["stderr"])
            for argv, r in zip(argvs, json.loads(proc.stdout))]
