"""One writer at a time: an exclusive flock on a file beside what is written (`flashkd.data`'s targets,
`flashkd records site`'s folder)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def exclusive(file: Path, busy: str, *, required: bool = True):
    """Hold an exclusive flock on `file` (made if absent) for the block; the file is removed at the end.
    Another process holding it: ValueError(busy) at once, nothing waits. flock is POSIX: without fcntl
    the block runs unlocked where not `required`, and raises OSError where it is. The lock is advisory
    (on NFS it holds across clients only where the server supports locking)."""
    try:
        import fcntl
    except ImportError:
        if required:
            raise OSError(f"cannot lock {file}: no POSIX flock (fcntl) on this platform") from None
        yield
        return
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)  # read-write: NFS maps flock to write locks
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(busy) from None
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"cannot lock {file}: {e.strerror}") from None
        # The writer that held the lock before removes the file when it ends: a lock on a file no longer
        # at that path excludes nobody, so take the one that is there now.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(file)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(file)
        os.close(fd)
