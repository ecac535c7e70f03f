"""The one exception type users see: a one-line message that says what is wrong and what to do."""
import tempfile
from pathlib import Path


class SpeculantError(ValueError):
    """Bad input or an unusable model. The CLI prints its message on one line and exits with 2."""


def check_writable(out, flag: str = "--out", beside: bool = False) -> None:
    """Fail now, not after minutes of work, where ``out`` (a folder written into, or with
    ``beside``, one written next to itself and renamed into place) cannot be written: a scratch
    folder is made and removed where the files will go (or its nearest existing parent)."""
    folder = Path(out).resolve()
    folder = folder if folder.is_dir() and not beside else folder.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        tempfile.TemporaryDirectory(dir=folder).cleanup()
    except OSError as e:
        raise SpeculantError(f"cannot write '{out}' ({e.strerror or e}): give {flag} a writable path") from None
