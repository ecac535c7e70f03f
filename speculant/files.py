"""Files a user names (a model, a draft model, a JSON schema, a layer plan, a prompts file), checked
before they are read: what is not a regular file (a FIFO, a device, a socket), a name the system
refuses (too long), a file that cannot be read (``/proc/self/mem``) or is larger than its use
allows is refused in one line naming it, never a hang on a FIFO, an endless read of ``/dev/zero``
or a traceback."""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from .errors import SpeculantError

SHOWN_CHARS = 120  # of a path in a message: a 10,000-character name is shown by its start and end


def shown(path) -> str:
    """A path for a one-line message: quoted, long ones cut in the middle."""
    text = str(path)
    if len(text) > SHOWN_CHARS:
        text = f"{text[: SHOWN_CHARS // 2]}...{text[-SHOWN_CHARS // 2 :]} ({len(text):,} characters)"
    return repr(text).replace("\\\\", "\\")


def _reason(e: OSError) -> str:
    return e.strerror or os.strerror(e.errno) if e.errno else str(e)


KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((words for test, words in KINDS if test(mode)), "not a regular file")


def status(path, what: str = "file") -> os.stat_result | None:
    """``os.stat(path)``, None where nothing is there; a name the system refuses (too long, a
    component that is a file, no permission) is a one-line SpeculantError naming ``what``."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            return None
        raise SpeculantError(f"cannot use the {what} {shown(path)}: {_reason(e)}") from None
    except ValueError:  # a NUL character in the name
        raise SpeculantError(f"cannot use the {what} {shown(path)}: the name holds a NUL character") from None


def exists(path, what: str = "file") -> bool:
    return status(path, what) is not None


def is_dir(path, what: str = "folder") -> bool:
    st = status(path, what)
    return st is not None and stat.S_ISDIR(st.st_mode)


def is_regular(path, what: str = "file") -> bool:
    st = status(path, what)
    return st is not None and stat.S_ISREG(st.st_mode)


def check_regular(path, what: str = "file", hint: str = "give a regular file") -> None:
    """Refuse what is not a regular file (a FIFO would block the reader; a device never ends)."""
    st = status(path, what)
    if st is None:
        raise SpeculantError(f"the {what} {shown(path)} does not exist: {hint}")
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise SpeculantError(f"the {what} {shown(path)} is a folder, not a file: {hint}")
        raise SpeculantError(f"the {what} {shown(path)} is {kind_of(st.st_mode)}, not a regular file: {hint}")


def read_bytes(path, what: str = "file", limit: int | None = None, count: int | None = None,
               hint: str = "give a regular file") -> bytes:
    """A regular file's bytes (its first ``count`` only, if given), opened without blocking and
    checked on the open descriptor (no race with a FIFO put in its place); more than ``limit``
    bytes is refused; a read error (``/proc/self/mem``) is one line."""
    check_regular(path, what, hint)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise SpeculantError(f"cannot open the {what} {shown(path)}: {_reason(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpeculantError(f"the {what} {shown(path)} is {kind_of(st.st_mode)}, not a regular file: {hint}")
        if limit is not None and count is None and st.st_size > limit:  # said by its size, not read first
            raise SpeculantError(f"the {what} {shown(path)} is larger than {limit:,} bytes: give a smaller one")
        want = count if count is not None else (limit + 1 if limit is not None else None)
        chunks, got = [], 0
        while want is None or got < want:
            piece = os.read(fd, 1 << 20 if want is None else min(1 << 20, want - got))
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
    except OSError as e:
        raise SpeculantError(f"cannot read the {what} {shown(path)}: {_reason(e)}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if limit is not None and count is None and len(data) > limit:
        raise SpeculantError(f"the {what} {shown(path)} is larger than {limit:,} bytes: give a smaller one")
    return data


def read_text(path, what: str = "file", limit: int | None = None, hint: str = "give a regular file") -> str:
    data = read_bytes(path, what, limit, hint=hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpeculantError(f"the {what} {shown(path)} is not UTF-8 text (byte {e.start}): {hint}") from None


def read_json_object(path, what: str, hint: str, limit: int = 16 << 20) -> dict:
    """A file holding a JSON object (settings), read within ``limit`` bytes: text that is not JSON,
    that nests deeper than Python's parser follows, or that holds something else is one line naming
    the file (``hint``: what to give instead), never a traceback from a library reading it later."""
    text = read_text(path, what, limit=limit, hint=hint)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpeculantError(f"{shown(path)} is not valid JSON (line {e.lineno}: {e.msg}): {hint}") from None
    except RecursionError:
        raise SpeculantError(f"{shown(path)} is nested too deeply to read: {hint}") from None
    if not isinstance(value, dict):
        raise SpeculantError(f"{shown(path)} holds a JSON {type(value).__name__}, not an object of settings: {hint}")
    return value


def as_path(text) -> Path:
    return Path(text).expanduser()


def write_folder(folder: Path, fill) -> None:
    """A folder written whole or not at all: ``fill(tmp)`` writes a temporary folder beside it, which
    then replaces ``folder`` (a run killed midway leaves no half-written folder to be read later)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        fill(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
