"""The state directory (``--state-dir``): state the cache keeps across restarts.

Opening it checks, before the model loads, that it is a directory this process can write, makes
it mode 0700, and creates (or reads) the server secret ``secret.key`` (32 random bytes, mode
0600) that keys every hash written there, so a state file confirms no prompt guess without it.
Every file in it is written 0600, whole files through a temporary name, an fsync and a rename
(``hotprefix.files.atomic.write_atomic``).

Imports no torch.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from hotprefix.config.sections import ConfigError
from hotprefix.files.atomic import write_atomic

log = logging.getLogger(__name__)

SECRET_FILE = "secret.key"
SECRET_BYTES = 32


class StateDirError(ConfigError):
    """The state directory cannot be used; the message names the path and the reason."""


class NotARegularFile(OSError):
    """The path is a symlink, a pipe, a directory or a device, where a regular file belongs."""


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file at ``path``: a symlink is not followed and a
    pipe is not waited on (its open would block until a writer comes).

    Raises:
        FileNotFoundError: there is nothing at ``path``.
        NotARegularFile: something other than a regular file is.
        OSError: it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink (O_NOFOLLOW), or a loop of them
            raise NotARegularFile(f"{path} is a symlink") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(f"{path} is not a regular file")
    return fd


def read_state_file(path: str) -> bytes | None:
    """A state file's bytes, or None when it does not exist.

    Raises:
        StateDirError: it is not a regular file (a directory; a pipe, whose read would block; a
            symlink, not followed) or cannot be read.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except NotARegularFile:
        raise StateDirError(f"{path} is not a regular file: move it away, or use another "
                            "--state-dir") from None
    except OSError as e:
        raise StateDirError(f"cannot read {path}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            return f.read()
        except OSError as e:
            raise StateDirError(f"cannot read {path}: {e.strerror or e}") from e


def append_whole(path: str, data: bytes) -> None:
    """Append ``data`` (whole records) to ``path`` (created 0600) in one ``O_APPEND`` write (a
    path that is a pipe or a symlink fails at once instead of blocking or being followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"short write ({written} of {len(data)} bytes)")


class StateDir:
    """An opened, checked state directory and its secret."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise StateDirError(f"--state-dir {path} exists and is not a directory")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            mode = stat.S_IMODE(os.stat(self.path).st_mode)
            if mode & 0o077:
                os.chmod(self.path, 0o700)
        except OSError as e:
            raise StateDirError(f"cannot use --state-dir {path}: {e.strerror or e}") from e
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise StateDirError(f"cannot use --state-dir {path}: not writable by this process")
        self.secret = self._secret()
        for name in os.listdir(self.path):  # files an older version left readable
            p = os.path.join(self.path, name)
            try:
                if os.path.isfile(p) and stat.S_IMODE(os.stat(p).st_mode) & 0o077:
                    os.chmod(p, 0o600)
            except OSError:
                pass

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _secret(self) -> bytes:
        p = self.file(SECRET_FILE)
        data = read_state_file(p)
        if data is not None:
            if len(data) == SECRET_BYTES:
                return data
            log.warning("%s is damaged (%d bytes); making a new secret (older state files are "
                        "ignored)", p, len(data))
        data = os.urandom(SECRET_BYTES)
        try:
            write_atomic(p, data)
        except OSError as e:
            raise StateDirError(f"cannot use --state-dir {self.path}: cannot write {SECRET_FILE}: "
                                f"{e.strerror or e}") from e
        return data
