"""Reading the files a user names (mesh layouts, data): every way one can be wrong is an error naming the file."""

from __future__ import annotations

from pathlib import Path

from jaxtrain.errors import UserInputError


def read_bytes(path: Path, what: str, error: type[UserInputError], missing: str = "") -> bytes:
    """The bytes of the file at `path`. A directory, a missing file (message `missing`, else "`what` 'path' does not
    exist.") or an unreadable one raises `error`, naming the file as `what` (e.g. "mesh layout file")."""
    if path.is_dir():
        raise error(f"{what} '{path}' is a directory; give the path of a file.")
    if not path.is_file():
        raise error(missing or f"{what} '{path}' does not exist.")
    try:
        return path.read_bytes()
    except OSError as err:
        raise error(f"cannot read {what} '{path}': {err.strerror or err}.") from None


def utf8_text(raw: bytes, path: Path, what: str, error: type[UserInputError]) -> str:
    """`raw` (the contents of `path`) as UTF-8 text; otherwise `error` with the line and offset of the first byte
    that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise error(
            f"{what} '{path}' is not UTF-8 text: byte 0x{raw[err.start]:02x} on line {line} (offset {err.start}). "
            "Convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None
