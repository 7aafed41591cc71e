"""The agent reads and writes in directories its ranks write (stack dumps, flight records and
their pipes, exit notes, rank logs): what job code plants there -- a symlink to a file of the
agent's, a FIFO where a file belongs -- is neither followed nor waited on
(lazarus.core.rankfiles). Each case plants it as job code would, with plain os calls."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from lazarus.agent import stacks
from lazarus.agent.adopt import read_note
from lazarus.agent.workers import tail
from lazarus.core import rankfiles
from lazarus.core.contract import dump_path, exit_note_path, flight_pipe_path, flight_record_path

SECRET = b"etcd password: hunter2\n"


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "agent-secret"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def catches_sigusr1():
    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    yield os.getpid()
    signal.signal(signal.SIGUSR1, old)


def test_a_stack_dump_planted_as_a_symlink_is_not_asked_for(tmp_path, secret, catches_sigusr1):
    pid = catches_sigusr1
    dump_path(tmp_path, pid).write_text("a dump\n")
    assert stacks.dumpable([pid], tmp_path) == [pid]  # the real thing is
    dump_path(tmp_path, pid).unlink()
    dump_path(tmp_path, pid).symlink_to(secret)
    assert stacks.dumpable([pid], tmp_path) == []
    assert stacks.capture([pid], tmp_path, timeout_s=0.2) == {}


def test_a_flight_record_planted_as_a_symlink_is_not_read(tmp_path, secret):
    flight_record_path(tmp_path, 41).write_bytes(b'{"entries": []}')
    flight_record_path(tmp_path, 42).symlink_to(secret)
    got = stacks.flight_records([41, 42], tmp_path, timeout_s=0.1)
    assert got == {41: b'{"entries": []}'}


def test_a_pipe_planted_as_a_symlink_to_a_file_is_not_written(tmp_path, secret):
    """The agent asks for a flight record by writing a byte into the rank's pipe: a symlink
    there would have a root agent write into any file."""
    flight_pipe_path(tmp_path, 43).symlink_to(secret)
    (tmp_path / "nccl-pipes").mkdir()
    (tmp_path / "nccl-pipes" / "rank_0.pipe").symlink_to(secret)
    assert stacks.ask_flight_records([43], tmp_path) == []
    assert stacks.request_flight_recorder_dumps(tmp_path, [0]) == []
    assert secret.read_bytes() == SECRET
    # a real pipe with a reader gets its byte
    os.mkfifo(flight_pipe_path(tmp_path, 44))
    reader = os.open(flight_pipe_path(tmp_path, 44), os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert stacks.ask_flight_records([44], tmp_path) == [44]
        assert os.read(reader, 1) == b"1"
    finally:
        os.close(reader)


def test_an_exit_note_planted_as_a_fifo_or_a_symlink_reads_as_none_at_once(tmp_path):
    started = time.time()
    note = {"pid": 50, "started": started, "code": 3}
    exit_note_path(tmp_path, 50).write_text(json.dumps(note))
    assert read_note(tmp_path, 50, started) == 3
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**note, "pid": 51}))
    exit_note_path(tmp_path, 51).symlink_to(elsewhere)
    assert read_note(tmp_path, 51, started) is None
    os.mkfifo(exit_note_path(tmp_path, 52))  # nobody ever writes it: an open would block
    got = []
    reading = threading.Thread(target=lambda: got.append(read_note(tmp_path, 52, started)),
                               daemon=True)
    reading.start()
    reading.join(10)
    assert not reading.is_alive() and got == [None]


def test_a_rank_log_planted_as_a_symlink_is_neither_read_nor_rotated(tmp_path, secret):
    log = tmp_path / "rank-0.log"
    log.symlink_to(secret)
    assert tail(log, 1000) == ""
    with pytest.raises(OSError):
        rankfiles.rotate(log, tmp_path / "rank-0.log.1")
    assert secret.read_bytes() == SECRET


def test_a_rank_log_is_rotated_in_place_and_a_planted_keep_file_is_replaced(tmp_path, secret):
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"line\n" * 100)
    appender = open(log, "ab")  # the rank's own descriptor, appending on
    keep = tmp_path / "rank-0.log.1"
    keep.symlink_to(secret)
    rankfiles.rotate(log, keep)
    assert secret.read_bytes() == SECRET  # not written through the symlink
    assert not keep.is_symlink() and keep.read_bytes() == b"line\n" * 100
    assert log.read_bytes() == b""
    appender.write(b"after\n")
    appender.close()
    assert tail(log, 1000) == "after"


def test_the_agents_own_log_in_a_rank_writable_dir_is_not_opened_through_a_plant(tmp_path, secret):
    """The zygote's and cold workers' logs lie beside the ranks' own, in a directory the
    ranks' user owns (--run-as): a symlink, FIFO, directory or hard link planted at the name
    is removed and the log made anew, never written through, and the agent goes on; a log
    that is its own is appended to."""
    def append(path, line: bytes) -> None:
        fd = rankfiles.open_log(path)
        os.write(fd, line)
        os.close(fd)

    link = tmp_path / "zygote.log"
    link.symlink_to(secret)
    fifo = tmp_path / "worker-1.log"
    os.mkfifo(fifo)
    directory = tmp_path / "worker-2.log"
    (directory / "inner").mkdir(parents=True)
    hard = tmp_path / "worker-3.log"
    os.link(secret, hard)
    for plant in (link, fifo, directory, hard):
        append(plant, b"agent\n")
        assert plant.is_file() and not plant.is_symlink() and plant.read_bytes() == b"agent\n"
    assert secret.read_bytes() == SECRET
    path = tmp_path / "worker-4.log"
    for line in (b"one\n", b"two\n"):
        append(path, line)
    assert path.read_bytes() == b"one\ntwo\n"


def test_a_hard_link_in_a_ranks_directory_is_not_taken(tmp_path, secret):
    """A rank log that is a hard link to a file of the agent's: rotating it would empty that
    file, reading it would report it."""
    log_path = tmp_path / "rank-0.log"
    os.link(secret, log_path)
    with pytest.raises(OSError):
        rankfiles.read(log_path)
    with pytest.raises(OSError):
        rankfiles.rotate(log_path, tmp_path / "rank-0.log.1")
    assert secret.read_bytes() == SECRET
