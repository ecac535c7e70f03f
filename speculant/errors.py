"""The one exception type users see: a one-line message that says what is wrong and what to do."""
import os
import stat
import tempfile
from pathlib import Path


class SpeculantError(ValueError):
    """Bad input or an unusable model. The CLI prints its message on one line and exits with 2."""


def check_writable(out, flag: str = "--out", beside: bool = False) -> None:
    """Fail now, not after minutes of work, where ``out`` (a folder written into, or with
    ``beside``, one written next to itself and renamed into place) cannot be written: a scratch
    folder is made and removed where the files will go (or its nearest existing parent)."""
    shown = str(out) if len(str(out)) <= 120 else f"{str(out)[:60]}...{str(out)[-60:]}"
    try:
        mode = os.stat(out).st_mode if os.path.lexists(out) else None
        if mode is not None and not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # a FIFO, a device (/dev/null)
            raise SpeculantError(f"cannot write '{shown}': it is not a regular file or a folder: give {flag} "
                                 "a writable path")
        folder = Path(out).resolve()
        folder = folder if folder.is_dir() and not beside else folder.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        tempfile.TemporaryDirectory(dir=folder).cleanup()
    except SpeculantError:
        raise
    except OSError as e:  # /proc/x, a read-only folder, a name too long
        raise SpeculantError(f"cannot write '{shown}' ({e.strerror or e}): give {flag} a writable path") from None
    except ValueError:  # a NUL character in the name
        raise SpeculantError(f"cannot write {shown!r}: the name holds a NUL character: give {flag} a writable "
                             "path") from None
