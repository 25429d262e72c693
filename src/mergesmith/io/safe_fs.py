"""Create, replace and remove files below a trusted directory without ever following a symbolic link.

Why: an output directory may sit in a shared or world-writable place (/tmp, a group scratch disk) or be a
copy of another one, and anybody who can create entries in it can plant a link where mergesmith is about
to write (`<state>/partial/<shard>.partial`, `<state>/.journal.json.tmp`, where `<state>` is
`.cache/huggingface/mergesmith`) or clean (the state directory itself, before `--overwrite` empties
it). Opening those names by path follows the link and writes or deletes outside the directory. So
everything below the trusted root goes through directory descriptors:

- the root (the output directory the user named, or the cache directory) is opened as given: a link
  the user chose there is the user's business;
- every directory below it is opened component by component with `O_NOFOLLOW|O_DIRECTORY`, and a link
  there is refused with one line (`LinkError`, exit 2): a directory is never ours to replace, since
  its contents might be somebody else's;
- every file is created new (`O_CREAT|O_EXCL|O_NOFOLLOW`) after whatever had its name was removed
  (a planted link is unlinked, never followed), and put in place with `rename` between two such
  directory descriptors, which replaces a link at the final name instead of writing through it;
- a tree is removed with `shutil.rmtree(dir_fd=...)`, which never follows links (its fd-based
  implementation is the one the standard library marks `avoids_symlink_attacks`).

The standard library has the pieces (`os.open(dir_fd=)`, `os.replace(src_dir_fd=, dst_dir_fd=)`,
`shutil.rmtree(dir_fd=)`) but no function that walks a relative path refusing links; that walk is the
hand-written part here, twenty lines, and it has a test per attack in `tests/test_link_safety.py`.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
DIR_FLAGS = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC


class LinkError(OutputError):
    """A symbolic link sits where mergesmith would descend into a directory or clean one."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(
            f"{path}: is a symbolic link; mergesmith never writes or deletes through links "
            "(remove the link, or choose another directory)"
        )


def parts_under(root: Path, path: Path) -> tuple[str, ...]:
    """The components of `path` below `root`, lexically (`root` must be a prefix of `path`)."""
    try:
        rel = Path(path).relative_to(root)
    except ValueError:
        raise ValueError(f"{path} is not below {root}") from None
    parts = tuple(p for p in rel.parts if p not in ("", "."))
    if ".." in parts:
        raise ValueError(f"{path}: '..' below {root}")
    return parts


def is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_dir(root: Path | str, parts: Sequence[str] = (), *, create: bool = False, mode: int = 0o755) -> int:
    """A descriptor of `root/parts...`: `root` opened as given, every component below it with
    O_NOFOLLOW (made with `mode` first when `create`). A link below the root raises `LinkError`."""
    root = Path(root)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    where = root
    try:
        for part in parts:
            where = where / part
            if create:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and is_link(fd, part):
                    raise LinkError(where) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def opened_dir(root: Path | str, parts: Sequence[str] = (), *, create: bool = False) -> Iterator[int]:
    """`open_dir` as a context manager (the descriptor is closed at the end)."""
    fd = open_dir(root, parts, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def dir_of(root: Path, path: Path, *, create: bool = False) -> int:
    """A descriptor of `path`'s parent, walked from `root` without following links."""
    return open_dir(root, parts_under(root, Path(path).parent), create=create)


def remove_entry(dir_fd: int, name: str) -> bool:
    """Remove `name` from the directory if it is there and not a directory (a link is removed itself,
    never followed). True when something was removed; a directory raises IsADirectoryError."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory where a file belongs", name)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def create_new_file(dir_fd: int, name: str, mode: int = 0o644, flags: int = os.O_RDWR) -> int:
    """Remove whatever has `name` (a planted link included) and create the file new:
    O_CREAT|O_EXCL|O_NOFOLLOW, so a link planted between the two steps makes it fail, never write."""
    remove_entry(dir_fd, name)
    return os.open(name, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)


def open_regular(dir_fd: int, name: str, flags: int = os.O_RDONLY) -> int:
    """Open an existing regular file without following a link (a link or non-file raises OSError)."""
    fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", name)
    return fd


def open_lock_file(dir_fd: int, name: str, mode: int = 0o644) -> int:
    """Open (creating if needed) a lock file that must keep its inode across runs, so it is not created
    new each time; a link in its place is removed first and never followed, and a non-file refused."""
    for _ in range(8):
        try:
            return open_regular(dir_fd, name, os.O_RDWR)
        except FileNotFoundError:
            pass
        except OSError:
            if not is_link(dir_fd, name):
                raise
            os.unlink(name, dir_fd=dir_fd)
        try:
            return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
        except FileExistsError:  # another run created it just now: open that one
            continue
    raise OSError(errno.EAGAIN, "lock file keeps changing", name)


def replace_atomically(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename `src` onto `dst` (each name in its directory): whatever `dst` was, a link included, is
    replaced, never followed."""
    os.replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)


def fsync_fd(fd: int) -> None:
    """fsync a directory descriptor (makes a rename durable); filesystems that refuse it are ignored."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def write_new_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Create `name` new and write `data` to it, fsync'ed."""
    fd = create_new_file(dir_fd, name, mode, os.O_WRONLY)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(dir_fd: int, name: str) -> None:
    """Remove `name` from the directory: a directory with everything in it (links inside are removed,
    never followed), anything else (a link included) by unlinking it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def read_regular(dir_fd: int, name: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file, not through a link (a link raises OSError)."""
    fd = open_regular(dir_fd, name)
    try:
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if limit is not None and total > limit:
                raise OSError(errno.EFBIG, "file too large", name)
        return b"".join(chunks)
    finally:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """Make (mode 0700) or check a per-user directory at a predictable place such as /tmp/mergesmith-<uid>:
    anybody may have made that name first, as a link or as a directory they can write to, and then
    read or swap what we stage there. A link, a directory owned by another user or one that others can
    write to is refused in one line."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise LinkError(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: exists and is not a directory")
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise OutputError(
            f"{path}: belongs to another user or others can write to it; mergesmith stages files only in a "
            "private directory (remove it, or set MERGESMITH_STAGING)"
        )
    return path
