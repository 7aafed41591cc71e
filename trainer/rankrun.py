"""Start one rank of a round: the one launch path of every job (docs/adopting.md).

A parked worker (lazarus.trainer.worker --park: Python, torch and the trainer imported) takes
its assignment and runs the job's command in torchrun's environment:
  - the round's own store: the agent that hosts the round publishes its port in the agent's
    long-lived store (contract.round_port_key); MASTER_ADDR:MASTER_PORT name it, so
    `init_process_group()` from the environment joins this round and never a dead one's keys;
  - the rank's output goes to its round's log file on the node (the agent bounds its size);
  - a Python command (`python train.py ...`, `python -m pkg ...`, the built-in trainer) runs
    inside this process, so a restart pays neither a process start nor `import torch`;
    another Python by its path replaces this process with that interpreter, which runs the
    command the same way (lazarus.trainer.rankboot); any other program replaces it too, with
    a watcher beside it (lazarus.trainer.progwatch).
A rank of a script that reports nothing itself (level 0) is watched from a thread in its
process (lazarus.trainer.collwatch): whether it joined its process group, and its
collectives. Its final destroy_process_group() is bounded in time (lazarus.trainer.teardown).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
import warnings
from datetime import timedelta
from typing import NoReturn

from lazarus.core import exitcodes, jobcommand
from lazarus.core.contract import (ASSIGNMENT_ENV, NCCL_DEFAULTS, PG_TIMEOUT_ENV,
                                   SCRIPT_PG_TIMEOUT_ENV, WorkerAssignment, round_port_key,
                                   torchrun_env)
from lazarus.core.errors import CheckpointError, UserError
from lazarus.trainer import exitnote
from lazarus.trainer.peerloss import is_peer_failure
from lazarus.trainer.rankprocess import this_process

# How long a rank waits for the agent hosting its round to publish the round's store: the
# hosting agent does so when it reads the round record, as every agent does.
PORT_WAIT = timedelta(seconds=120)


# The built-in trainer's one connection of a round to the store of the agent the round
# names: rankrun reads the round's port through it and the trainer makes its groups through
# it (one connect a round where there were two: each is an accept and a reverse name lookup
# on the store's one loop thread, docs/scale.md). Not kept past the round: a thread the old
# round left blocked in a store call would hold it. (host, port, store)
_kept: tuple[str, int, object] | None = None


def agent_store(host: str, port: int, timeout: timedelta):
    """This round's connection to the store at host:port (made on first use)."""
    import torch.distributed as dist

    global _kept
    if _kept is not None and _kept[:2] == (host, port):
        _kept[2].set_timeout(timeout)
        return _kept[2]
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    _kept = (host, port, store)
    return store


def drop_agent_store() -> None:
    """The round is over for this process: the next one connects anew."""
    global _kept
    _kept = None


def round_port(a: WorkerAssignment, *, keep: bool = False) -> int:
    """The port of the round's own store, as its hosting agent published it. `keep`: through
    the connection the built-in trainer goes on with (`agent_store`)."""
    import torch.distributed as dist

    try:
        store = (agent_store(a.store_host, a.store_port, PORT_WAIT) if keep else
                 dist.TCPStore(a.store_host, a.store_port, is_master=False, timeout=PORT_WAIT,
                               wait_for_workers=False))
        return int(store.get(round_port_key(a.round)).decode())
    except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
        raise ConnectionError(f"round {a.round}: the store of {a.store_host}:{a.store_port} "
                              f"did not give the round's port ({str(e).splitlines()[0]:.200})")


def environment(a: WorkerAssignment, master_port: int) -> dict[str, str]:
    """This process's environment (the agent's, less its secrets), the job's additions, then
    torchrun's variables and the assignment itself: the job cannot override who the rank is."""
    return {**NCCL_DEFAULTS, **os.environ, **a.env, **torchrun_env(a, master_port),
            ASSIGNMENT_ENV: a.to_json()}


def _redirect_output(path: str) -> None:
    """This rank's stdout and stderr, from here on and in whatever it execs, into `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def collective_timeout() -> float | None:
    """The default collective timeout of the process groups a script makes: the operator's
    ($LAZARUS_PG_TIMEOUT_S), else the agent's (twice its first-step allowance), applied to
    torch's defaults -- a script that passes a timeout of its own keeps it. The agent's hang
    detector acts first, with stacks and a culprit; this is the backstop."""
    import torch.distributed.constants as constants
    import torch.distributed.distributed_c10d as c10d

    for name in (PG_TIMEOUT_ENV, SCRIPT_PG_TIMEOUT_ENV):
        try:
            seconds = float(os.environ.get(name) or 0)
        except ValueError:
            continue
        if seconds > 0:
            timeout = timedelta(seconds=seconds)
            c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
            # Frameworks pass torch's default explicitly, read from here when they are
            # imported (Lightning's strategies: `timeout=default_pg_timeout`): the script
            # imports them after this.
            constants.default_pg_timeout = constants.default_pg_nccl_timeout = timeout
            return seconds
    return None


def enter(a: WorkerAssignment) -> dict[str, str]:
    """Make this process rank `a.rank` of round `a.round`: its output into the round's log,
    its environment torchrun's for the round (returned). A rank that survived its round
    (lazarus.trainer.inplace) comes here again for the next one."""
    try:
        if a.log_path:  # a directory the rank's user cannot write ends it here, said why
            _redirect_output(a.log_path)
        # the built-in trainer's rank talks to the same store next (lazarus.trainer.worker)
        env = environment(a, round_port(a, keep=jobcommand.is_builtin(a.command)))
        if a.cwd:
            os.chdir(a.cwd)
        jobcommand.check_runnable(a.command, cwd=a.cwd, path=env.get("PATH"))
    except UserError as e:
        # The job cannot start here: the agent publishes why, and the daemon fails the run.
        _refuse(a, str(e))
    except (ConnectionError, OSError) as e:
        print(f"rank {a.rank} round {a.round}: {e}", file=sys.stderr, flush=True)
        exitnote.exit_now(1)
    os.environ.clear()
    os.environ.update(env)
    return env


def run_rank(a: WorkerAssignment) -> NoReturn:
    """Become rank `a.rank` of round `a.round`: never returns (the command's exit code ends
    this process, or the command replaces it)."""
    env = enter(a)
    how = jobcommand.how_run(a.command)
    if how == jobcommand.OWN_PYTHON:
        from lazarus.trainer import rankboot  # here: only a job in its own Python needs it
        env[rankboot.ROOTS_ENV] = json.dumps(rankboot.roots())
        _exec(rankboot.exec_args(a.command[0], jobcommand.python_options(a.command)), env)
    if how == jobcommand.PROGRAM:
        from lazarus.trainer import progwatch  # here: only a program's rank has a watcher
        progwatch.start(a)
        _exec(a.command, env)
    run_here(a)


def _exec(argv: list[str], env: dict[str, str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:  # checked runnable a moment ago: gone or changed since
        print(f"lazarus: cannot run {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        exitnote.exit_now(127)


def run_own_python() -> NoReturn:
    """(In the job's interpreter, lazarus.trainer.rankboot) run the rank's command here."""
    a = WorkerAssignment.from_json(os.environ[ASSIGNMENT_ENV])
    try:
        import torch  # noqa: F401
    except ImportError as e:
        _refuse(a, f"[job] command: {sys.executable} cannot import torch ({e}); install "
                   "torch in the job's environment (docs/adopting.md, \"Your environment\")")
    run_here(a)


def run_here(a: WorkerAssignment) -> NoReturn:
    """Run the rank's Python command in this interpreter (the agent's or the job's own):
    never returns."""
    if not jobcommand.is_builtin(a.command):
        collective_timeout()
        from lazarus.trainer.collwatch import watch  # here: only a script's rank is watched
        watch()
    # here: only a command run in this process needs it (run_rank's exec paths do not)
    from lazarus.trainer.teardown import bound_destroy
    bound_destroy()
    exitnote.finish(_run_python(a.command))


def _refuse(a: WorkerAssignment, reason: str) -> NoReturn:
    from lazarus.trainer.session import connect  # here: only a refused rank talks to the agent

    print(f"rank {a.rank} round {a.round}: {reason}", file=sys.stderr, flush=True)
    session = connect(rank=a.rank, round=a.round, socket_path=a.report_socket)
    session.refused(reason)
    session.close()
    exitnote.exit_now(exitcodes.REFUSED)


def _run_python(command: list[str]) -> int:
    """Run `python ...` as the interpreter would, in this process; its exit code."""
    kind, target, argv = jobcommand.split_python(command)
    sys.argv = argv
    try:
        if kind == "script":
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.path.insert(0, os.getcwd())
            with warnings.catch_warnings():
                # The built-in trainer's module is imported already (parking warmed it up):
                # runpy's warning that it runs it again as __main__ is expected.
                warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, "")
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except CheckpointError:
        # A copy to restore that does not load (Session.restore): the daemon restores from
        # elsewhere next, instead of the same copy again.
        traceback.print_exc()
        return exitcodes.BAD_CHECKPOINT
    except UserError as e:  # Lazarus's own command refusing its input: one line, as the CLI
        print(f"lazarus: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException as e:  # the script's own error: shown as the interpreter would
        traceback.print_exc()
        if isinstance(e, Exception) and (is_peer_failure(e) or this_process().was_told()):
            # A collective failed because a peer is gone: said in the exit code, so that the
            # daemon names the peer, not this rank (as the built-in trainer does).
            print(f"lazarus: a peer of rank {os.environ.get('RANK')} is gone; exiting with "
                  f"{exitcodes.PEER_LOST}", file=sys.stderr)
            return exitcodes.PEER_LOST
        return 1
    return 0
