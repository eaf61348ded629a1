"""One writer at a time: an exclusive flock on a file beside what is written (`flashkd.data`'s targets,
`flashkd records site`'s folder); and its result put in place whole, by renames (`replace_dir`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

# What a lock file flashkd makes holds. Only a file holding it is removed when the block ends: a
# regular file found at the path without it is someone else's, used as the lock and left as it was.
_MARK = b"flashkd lock file: removed when its writer ends\n"


def kind(mode: int) -> str:
    """What a file of st_mode `mode` is, for a message: "a directory", "a FIFO", ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


@contextlib.contextmanager
def exclusive(file: Path, busy: str, *, what: str, required: bool = True):
    """Hold an exclusive flock on `file` (made if absent) for the block; the file is removed at the end
    if flashkd made it. Another process holding it: ValueError(busy) at once, nothing waits. Something
    other than a regular file at the path (a directory, a FIFO, a link): ValueError naming `what` (the
    argument the path follows from) and the path. flock is POSIX: without fcntl the block runs unlocked
    where not `required`, and raises OSError where it is. The lock is advisory (on NFS it holds across
    clients only where the server supports locking)."""
    try:
        import fcntl
    except ImportError:
        if required:
            raise OSError(f"cannot lock {file}: no POSIX flock (fcntl) on this platform") from None
        yield
        return
    while True:
        fd = _open(file, what)
        if fd is None:  # removed between our two opens by the writer that held it: make it again
            continue
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
        try:
            if _made_by_flashkd(fd) and os.path.samestat(os.fstat(fd), os.lstat(file)):
                os.unlink(file)
        finally:
            os.close(fd)


def _open(file: Path, what: str) -> int | None:
    """A read-write descriptor (NFS maps flock to write locks) of the lock file: made, and marked as
    flashkd's, where absent; else the regular file there; None where it went between the two opens."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        os.write(fd, _MARK)  # before the flock: whoever holds the lock then sees the file as flashkd's
        return fd
    # O_NONBLOCK: a FIFO must not wait for a writer; O_NOFOLLOW: a link could lead anywhere
    try:
        fd = os.open(file, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory (EISDIR), a socket (ENXIO), a link (ELOOP), a file we may not write, ...
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISREG(mode):
            raise OSError(e.errno, f"cannot lock {file}: {e.strerror}") from None
        raise _not_a_lock(file, what, kind(mode)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_a_lock(file, what, kind(mode))
    return fd


def _not_a_lock(file: Path, what: str, got: str) -> ValueError:
    return ValueError(f"{what}: expected no file or a lock file at {file} (flashkd locks it while it writes), got "
                      f"{got}; move it away")


def _made_by_flashkd(fd: int) -> bool:
    """Whether the locked file is one flashkd made (by this writer, or by one killed before it removed
    it): it holds _MARK and nothing else."""
    return os.fstat(fd).st_size == len(_MARK) and os.pread(fd, len(_MARK), 0) == _MARK


def dir_or_nothing(path: Path, what: str) -> Path:
    """`path`, where a writer builds or sets a directory aside: a directory or nothing must be there.
    Anything else (a file, a link, a FIFO, which rmtree would open and wait on): ValueError naming `what`."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{what}: expected a directory or nothing at {path} (flashkd builds there), got "
                         f"{kind(mode)}; move it away")
    return path


def fsync(path: Path):
    """Make a file's data, or a directory's entries, durable (a rename is only as durable as the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(new: Path, out: Path, aside: Path, *, what: str) -> None:
    """Put the finished directory `new` at `out` by renames, never by removing `out` file by file, so
    that whoever looks at `out` meanwhile sees the old directory, the new one or nothing: a non-empty
    `out` goes to `aside` first, comes back if `new` cannot move in, and is removed once the renames are
    durable (an empty one is replaced by the one rename). `aside` (`dir_or_nothing`, ValueError naming
    `what`) may hold what a crash between the renames left there: it is removed first. Call it holding
    the writer's lock (`exclusive`)."""
    if os.path.isdir(dir_or_nothing(aside, what)):
        shutil.rmtree(aside)
    if out.is_dir() and any(out.iterdir()):
        os.rename(out, aside)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(aside, out)  # the old directory back: a failed replacement loses nothing
            raise
        fsync(out.parent)
        shutil.rmtree(aside)
    else:
        os.rename(new, out)  # rename(2) replaces an empty directory
        fsync(out.parent)
