"""Output directories checked before anything is written: a directory (or one that can be created) this process
can really write, so a file or read-only path is one line up front instead of a traceback at the first write."""
from __future__ import annotations

import errno
import os
import tempfile

from .config import ConfigError


def check_writable(path: str, flag: str, shown: str | None = None) -> None:
    """`path` is (or can be created as) a directory this process can write: a real file is created and removed,
    since permission bits alone say nothing for root or a read-only mount. `shown`: the name the user gave,
    when `path` is derived from it (the parent a temporary goes to)."""
    shown = shown or path
    probe = path
    while not os.path.isdir(probe):
        if os.path.lexists(probe):
            raise ConfigError(f"{flag} {shown}: {probe} is a file, not a directory; choose a directory for {flag}")
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == os.path.abspath(probe):
            break
        probe = parent
    try:
        if not os.access(probe, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        fd, name = tempfile.mkstemp(prefix=".shardwise-probe-", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        where = shown if os.path.abspath(probe) == os.path.abspath(shown) else f"{shown} (to be created in {probe})"
        raise ConfigError(f"{flag} {where} is not writable ({e.strerror or e}); choose a writable directory "
                          f"for {flag}") from None
