"""Whether a file the server is about to load can have been written by someone else: owner, mode, links.

The ONNX graph cache (:mod:`.graph_cache`) uses it so that a graph planted by another user is never run:

* :func:`make_private_dir` creates the cache directory (and any missing parent) with mode 0700 and refuses
  one that exists but is owned by another uid or is writable by group or others. Root (uid 0) counts as a
  trusted owner everywhere: it can write any file anyway, and images ship root-owned trees.
* :func:`open_dir` / :func:`read_file` open by descriptor: a graph file is opened once with ``O_NOFOLLOW``
  (a symbolic link is refused, not followed: its target could change between the check and the load, and
  could be anyone's), ``fstat`` of that descriptor is what is checked, and the bytes read from it are what
  the caller hashes and hands to ONNX Runtime. Directories below a checked one are opened relative to its
  descriptor, so a directory swapped after the check is not the one read.

The checks are the same as OpenSSH's ``StrictModes`` for the file itself; parents above the cache
directory are not checked (a Kubernetes ``emptyDir`` is 0777, and the server's own 0700 directory inside it
is what keeps other users out).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import ConfigError


class Refused(Exception):
    """A file or directory the server will not load from; the message names the path, owner, mode and fix."""


def server_uid() -> int:
    """The uid files must belong to (besides root): the process's effective uid. A seam for tests that cannot
    chown."""
    return os.geteuid()


def trusted_owners(*extra: int) -> frozenset[int]:
    """The server's uid, root, and ``extra`` (e.g. the owner of a checkpoint directory)."""
    return frozenset((server_uid(), 0, *extra))


def describe(st: os.stat_result) -> str:
    """``owner uid N, mode 0NNN`` of a stat result."""
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def problem(st: os.stat_result, trusted: frozenset[int]) -> str | None:
    """Why a file or directory with this stat could have been written by someone else, or None."""
    if st.st_uid not in trusted:
        return f"owned by uid {st.st_uid}, not by the server's uid {server_uid()} (or root)"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"writable by {' and '.join(writable)}"
    return None


def make_private_dir(path: Path, what: str) -> None:
    """Create ``path`` (and missing parents) with mode 0700, or check the existing one.

    ``os.makedirs``'s mode is masked by the umask and not applied to the parents it creates, so each
    directory created here is chmod-ed 0700 afterwards (the XDG spec's mode for a missing cache directory).

    Raises:
        ConfigError: ``path`` cannot be a directory, or it exists owned by another uid (not root) or writable
            by group or others; the message names ``what``, the path, the owner uid, the mode and the fix.
    """
    path = Path(os.path.abspath(path))
    created = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        created.append(p)
        p = p.parent
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be used as a directory ({exc.strerror or exc})") from exc
    for d in created:
        try:
            os.chmod(d, 0o700, follow_symlinks=False)
        except OSError:  # made meanwhile by someone else: the check below decides about the leaf
            pass
    try:
        fd = open_dir(path)
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be used as a directory ({exc.strerror or exc})") from exc
    try:
        check_private_dir(fd, path, what)
    finally:
        os.close(fd)


def check_private_dir(fd: int, path: Path, what: str) -> None:
    """Refuse the directory open as ``fd`` unless the server (or root) owns it and no group or other user
    can write it.

    Raises:
        ConfigError: naming ``what``, the path, the owner uid, the mode and what to do.
    """
    st = os.fstat(fd)
    why = problem(st, trusted_owners())
    if why:
        fix = (f"`chmod go-w {path}` (0700 is what the server creates)" if st.st_uid in trusted_owners() else
               "use a directory of the server's own user")
        raise ConfigError(
            f"{what} {str(path)!r} is {why} ({describe(st)}), so another user could plant graphs in it; the "
            f"server (uid {server_uid()}) uses only a cache directory that it or root owns and that no group or "
            f"other user can write: {fix}, or point onnx_cache_dir at a path that does not exist yet (the "
            f"server creates it with mode 0700; on a shared or 0777 volume such as an emptyDir, a subdirectory "
            f"like {path / 'relserve'})")


def open_dir(path: str | os.PathLike, *, parent_fd: int | None = None, follow: bool = True) -> int:
    """A read-only descriptor of directory ``path`` (relative to ``parent_fd`` when given); ``follow=False``
    refuses a symbolic link (``OSError`` ELOOP). The caller closes it.

    Raises:
        OSError: not a directory, missing, a link with ``follow=False``, unreadable.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW)
    return os.open(path, flags, dir_fd=parent_fd)


def check_dir(fd: int, shown: Path, trusted: frozenset[int]) -> None:
    """Refuse the directory open as ``fd`` when someone else could have written into it.

    Raises:
        Refused: naming ``shown``, the owner uid and the mode.
    """
    st = os.fstat(fd)
    why = problem(st, trusted)
    if why:
        raise Refused(f"directory {shown} is {why} ({describe(st)})")


def read_file(dir_fd: int, name: str, shown: Path, trusted: frozenset[int], *, missing_ok: bool = False) -> bytes | None:
    """The bytes of ``name`` in the directory open as ``dir_fd``, read from the one descriptor whose
    ``fstat`` passed the checks (so what is checked is what is returned). None when it does not exist and
    ``missing_ok``.

    Raises:
        Refused: a symbolic link (not followed), not a regular file, owned by another uid (not root or
            ``trusted``), writable by group or others, or unreadable; the message names ``shown``, the owner
            uid, the mode and the fix.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT and missing_ok:
            return None
        if exc.errno == errno.ELOOP:
            raise Refused(f"{shown} is a symbolic link; graph files are opened without following links (a "
                          f"link's target could be anyone's and could change after the check): put the file "
                          f"itself there") from exc
        raise Refused(f"{shown} cannot be opened ({exc.strerror or exc})") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown} is not a regular file")
        why = problem(st, trusted)
        if why:
            fix = f"`chmod go-w {shown}`" if st.st_uid in trusted else "replace it with a file of your own"
            raise Refused(f"{shown} is {why} ({describe(st)}), so another user could have written it; {fix}")
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise Refused(f"{shown} cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
