"""A filesystem that never answers a read, and ranks stuck on it: the kernel waits a hung
network or FUSE mount puts a process in, made for real.

Run as `unshare --user --map-root-user --mount python stuckfs.py MNT DUMP_DIR` (no root
needed, the mount seen by nobody outside): it mounts a FUSE filesystem at MNT over the raw
/dev/fuse protocol -- one file, `data`, whose every lookup and open is answered and whose
reads never are -- and starts, one per line on its stdin, a process that reads the file or
opens it, printing its pid:

- `read`: a rank as a worker runs one (its stacks dumped on SIGUSR1, lazarus.trainer.stackdump)
  with a thread beside the main one that starts threads now and then, as a data loader or a
  pool does. Its main thread reads `data` through the page cache and sleeps in D on the page
  the unanswered read locks -- a wait a SIGKILL ends. The other thread takes SIGUSR1 and
  answers the dump.
- `open`: a process that opens `data` once a read is pending: the open empties the page
  cache of the file and sleeps in D on that locked page, in a wait no signal ends (as on an
  NFS hard mount).

When its stdin closes it exits; its /dev/fuse descriptor goes with it, the kernel aborts the
connection, and every process waiting on the mount wakes with an error and can end.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import subprocess
import sys
import threading

# struct fuse_in_header, fuse_out_header and fuse_attr (include/uapi/linux/fuse.h)
_IN = struct.Struct("<IIQQIIIHH")
_OUT = struct.Struct("<IiQ")
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
LOOKUP, FORGET, GETATTR, OPEN, READ = 1, 2, 3, 14, 15
RELEASE, FLUSH, INIT, INTERRUPT = 18, 25, 26, 36
FUSE_ASYNC_READ = 1  # reads go out as background requests: the reader waits on the page
SIZE = 1 << 20
_MS_NOSUID, _MS_NODEV = 2, 4

RANK = """
import sys, threading, time
from lazarus.trainer.stackdump import enable_stack_dumps
enable_stack_dumps(sys.argv[1])

def loader():
    while True:
        time.sleep(0.1)
        threading.Thread(target=lambda: None).start()

threading.Thread(target=loader, daemon=True).start()
with open(sys.argv[2], "rb") as f:
    f.read(4096)
"""
OPENER = "import sys; open(sys.argv[1], 'rb')"


def _attr(ino: int, mode: int, size: int) -> bytes:
    return _ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def mount(mnt: str) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
    if libc.mount(b"stuckfs", mnt.encode(), b"fuse", _MS_NOSUID | _MS_NODEV, opts.encode()):
        sys.exit(f"mount: {os.strerror(ctypes.get_errno())}")
    return fd


def serve(fd: int) -> None:
    def reply(unique: int, body: bytes = b"", err: int = 0) -> None:
        os.write(fd, _OUT.pack(_OUT.size + len(body), -err, unique) + body)

    while True:
        try:
            req = os.read(fd, (1 << 20) + 4096)
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            return  # ENODEV: unmounted
        _, op, unique, node, *_ = _IN.unpack_from(req)
        body = req[_IN.size:]
        if op == INIT:
            readahead = struct.unpack_from("<IIII", body)[2]
            reply(unique, struct.pack("<IIIIHHIIHHI", 7, 31, readahead, FUSE_ASYNC_READ, 16, 12,
                                      1 << 17, 1, 32, 0, 0) + bytes(28))
        elif op == LOOKUP and node == 1 and body.split(b"\0")[0] == b"data":
            reply(unique, struct.pack("<QQQQII", 2, 0, 60, 60, 0, 0)
                  + _attr(2, stat.S_IFREG | 0o444, SIZE))
        elif op == GETATTR:
            attr = (_attr(1, stat.S_IFDIR | 0o555, 0) if node == 1
                    else _attr(2, stat.S_IFREG | 0o444, SIZE))
            reply(unique, struct.pack("<QII", 60, 0, 0) + attr)
        elif op == OPEN:
            reply(unique, struct.pack("<QIi", 1, 0, 0))
        elif op in (READ, INTERRUPT, FORGET):
            continue  # never answered (FORGET takes no answer)
        elif op in (RELEASE, FLUSH):
            reply(unique)
        else:
            reply(unique, err=errno.ENOENT if op == LOOKUP else errno.ENOSYS)


def main(mnt: str, dump_dir: str) -> None:
    fd = mount(mnt)
    threading.Thread(target=serve, args=(fd,), daemon=True).start()
    data = os.path.join(mnt, "data")
    print("mounted", flush=True)
    for line in sys.stdin:
        argv = ([sys.executable, "-c", RANK, dump_dir, data] if line.strip() == "read"
                else [sys.executable, "-c", OPENER, data])
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)  # never this fd: close_fds
        print(f"pid {proc.pid}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
