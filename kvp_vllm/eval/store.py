"""Result-folder files, plain or gzip-compressed: the rows store and the readers/writers around it.

A kvp-eval folder keeps its raw files compressed: `rows.jsonl.gz` (the resume store),
`progress.log.gz` and `per_sample.csv.gz`; older folders have the plain names, and every reader
accepts either (`find`, `open_text`, `read_rows`). The small summaries (results.json, aggregate.csv,
run.json) stay plain.

Appending to a `.gz` store writes one gzip member per call; a file of several members is one stream
for `gzip`, `zcat` and Python's gzip module (`zcat rows.jsonl.gz | head` works). The end of a run
rewrites the store as one member (`compact`), which compresses ~20-40% better than many small ones.

A write cut short (a crash, a killed process) leaves a truncated last member, as the plain store is
left with a partial last line. Reading keeps every complete line, also those of the cut member, and
drops the partial one, as for the plain store. The next append first cuts the damaged tail off and
rewrites its complete lines, so the rows appended after it are readable. Damage that is not a cut
tail (a corrupt byte in the middle) is never repaired silently: appending raises `StoreDamaged`.

A folder holds one store of a name: a plain `rows.jsonl` keeps being appended to (migrate it once
with `compress_folder`, or `kvp-eval --compress-store --out FOLDER`); a folder with both the plain and
the `.gz` file is an error (`MixedStore`), never two stores read as one.
"""

from __future__ import annotations

import csv
import fcntl
import gzip
import io
import json
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

GZ = ".gz"
RAW_FILES = ("rows.jsonl", "progress.log", "per_sample.csv")  # compressed in a result folder
_CHUNK = 1 << 16

PathLike = Union[str, Path]


class MixedStore(RuntimeError):
    """A folder holds both X and X.gz: two stores of one name."""


class StoreDamaged(RuntimeError):
    """A .gz store is corrupt before its end (not a write cut short): not repaired automatically."""


def _pair(path: PathLike) -> Tuple[Path, Path]:
    path = Path(path)
    if path.name.endswith(GZ):
        return path.with_name(path.name[:-len(GZ)]), path
    return path, path.with_name(path.name + GZ)


def find(path: PathLike) -> Optional[Path]:
    """The stored file for X or X.gz (either name may be given): the one that exists, None if neither;
    MixedStore if both do."""
    plain, gz = _pair(path)
    if plain.exists() and gz.exists():
        raise MixedStore(f"both {plain.name} and {gz.name} are in {plain.parent}: merge them into one "
                         f"(e.g. `cat {plain.name} | gzip >> {gz.name}` then remove {plain.name}) "
                         f"or remove the stale one")
    return plain if plain.exists() else gz if gz.exists() else None


def store_path(folder: PathLike, name: str = "rows.jsonl") -> Path:
    """Where to append `name` in a folder: the existing plain file of an older folder, else name.gz."""
    found = find(Path(folder) / name)
    return found if found is not None else Path(folder) / (name + GZ)


def is_gz(path: PathLike) -> bool:
    return str(path).endswith(GZ)


# ---------------------------------------------------------------------------------------------
# Reading a multi-member gzip file member by member


@dataclass
class _Scan:
    text: bytes          # decompressed bytes of the complete members
    good_end: int        # file offset just past the last complete member
    members: int         # complete members
    tail: bytes = b""    # what the damaged/cut member decompressed to before the damage
    damage: Optional[str] = None  # None, "cut" (truncated tail / zero padding) or "corrupt"


def _scan(data: Union[bytes, memoryview], start: int = 0) -> _Scan:
    view = memoryview(data)
    pos, members, out = start, 0, []
    while pos < len(view):
        if view[pos] == 0 and not bytes(view[pos:]).strip(b"\0"):  # zero bytes after the last member
            return _Scan(b"".join(out), pos, members, b"", "cut")
        d = zlib.decompressobj(wbits=31)
        parts, p = [], pos
        try:
            while not d.eof and p < len(view):
                chunk = view[p:p + _CHUNK]
                parts.append(d.decompress(chunk))
                p += len(chunk) - len(d.unused_data)
        except zlib.error:
            return _Scan(b"".join(out), pos, members, b"".join(parts), "corrupt")
        if not d.eof:  # the data ended inside this member: a write cut short
            try:
                parts.append(d.flush())
            except zlib.error:
                pass
            return _Scan(b"".join(out), pos, members, b"".join(parts), "cut")
        out.append(b"".join(parts))
        members += 1
        pos = p
    return _Scan(b"".join(out), pos, members)


def _complete_lines(text: bytes) -> bytes:
    """Up to and including the last newline: the partial line a cut write leaves is dropped."""
    return text[:text.rfind(b"\n") + 1]


def read_bytes(path: PathLike) -> bytes:
    """The (decompressed) content of X or X.gz; b"" if neither exists. A cut .gz tail gives what it
    decompresses to, as a plain file cut by a crash gives its bytes."""
    found = find(path)
    if found is None:
        return b""
    data = found.read_bytes()
    if not is_gz(found):
        return data
    s = _scan(data)
    return s.text + s.tail


@contextmanager
def open_text(path: PathLike, newline: Optional[str] = None) -> Iterator[io.TextIOBase]:
    """Open X or X.gz (either name may be given) for reading text: e.g.
    `with open_text(folder / "per_sample.csv", newline="") as f: csv.DictReader(f)`."""
    found = find(path)
    if found is None:
        raise FileNotFoundError(f"neither {_pair(path)[0]} nor {_pair(path)[1]} exists")
    if is_gz(found):
        with io.TextIOWrapper(io.BytesIO(read_bytes(found)), encoding="utf-8", newline=newline) as f:
            yield f
    else:
        with open(found, newline=newline) as f:
            yield f


def read_rows(path: PathLike) -> List[Dict]:
    """The JSON lines of a rows store (rows.jsonl or rows.jsonl.gz; [] if there is none). A line cut by
    an interrupted write is skipped."""
    rows = []
    for line in read_bytes(path).split(b"\n"):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line.decode("utf-8", errors="replace")))
        except json.JSONDecodeError:  # a line cut by an interrupted write
            continue
    return rows


def read_csv(path: PathLike) -> List[Dict[str, str]]:
    """A CSV written by write_csv (X or X.gz), as strings."""
    with open_text(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# Writing


@contextmanager
def _locked(path: Path):
    """An exclusive flock on `path` (created if missing), on the file the name points to now: a
    store replaced by compact() while we waited is reopened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield fd
                return
        finally:
            os.close(fd)  # closing releases the lock


def _repair_tail(fd: int, path: Path) -> bytes:
    """Under the lock: check the store (a full read: ~0.1 s for the 17 MB of the 2K folder, against
    minutes per sample); cut a damaged tail off and return its complete lines (to be written again);
    raise StoreDamaged for corruption before the tail."""
    size = os.fstat(fd).st_size
    s = _scan(os.pread(fd, size, 0) if size else b"")
    if s.damage == "corrupt":
        raise StoreDamaged(f"{path} is corrupt at byte {s.good_end} of {size} (not a write cut short): "
                           f"the rows before it read fine; keep `zcat` of the good part and remove the "
                           f"damaged bytes by hand")
    if s.damage == "cut":
        os.ftruncate(fd, s.good_end)
    return _complete_lines(s.tail)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _gzip_member(text: bytes) -> bytes:
    return gzip.compress(text, compresslevel=9, mtime=0)


def append_text(path: PathLike, text: str) -> None:
    """Append under an exclusive lock (processes running disjoint --tasks may share one folder):
    one gzip member to a .gz file, plain text otherwise. A partial last line or cut member left by a
    crash is dropped first (a cut member's complete lines are kept), so what is appended reads back."""
    path = Path(path)
    data = text.encode("utf-8")
    with _locked(path) as fd:
        if is_gz(path):
            data = _gzip_member(_repair_tail(fd, path) + data)
        else:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # end the cut line: it stays unreadable, the new rows do not
        _write_all(fd, data)
        os.fsync(fd)


def _jsonl(rows: Iterable[Dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def append_rows(path: PathLike, rows: Iterable[Dict]) -> None:
    """Append rows as JSON lines (see append_text)."""
    append_text(path, _jsonl(rows))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def compact(path: PathLike) -> bool:
    """Rewrite a .gz store of several members as one (atomically; the content is unchanged, a cut
    tail's partial line dropped). False when there was nothing to do."""
    path = Path(path)
    if not is_gz(path) or not path.exists():
        return False
    with _locked(path) as fd:
        data = path.read_bytes()
        s = _scan(data)
        if s.damage == "corrupt":
            return False  # left for the next append to report
        if s.members <= 1 and s.damage is None:
            return False
        _write_atomic(path, _gzip_member(s.text + _complete_lines(s.tail)))
        return True


def filter_rows(path: PathLike, keep) -> int:
    """Rewrite a store (plain or .gz, atomically, under the append lock) with only the rows for which
    keep(row) is true; returns how many rows were dropped."""
    path = Path(path)
    with _locked(path):
        rows = read_rows(path)
        kept = [r for r in rows if keep(r)]
        if len(kept) != len(rows):
            text = _jsonl(kept).encode("utf-8")
            _write_atomic(path, _gzip_member(text) if is_gz(path) else text)
        return len(rows) - len(kept)


def write_csv(path: PathLike, rows: List[Dict], fields: Optional[List[str]] = None) -> None:
    """A CSV of the rows (fields: the given ones, else every key in order of appearance); gzip when
    the name ends in .gz, and then a stale plain copy of the same name is removed."""
    path = Path(path)
    if fields is None:
        fields = []
        for r in rows:
            fields.extend(k for k in r if k not in fields)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    _write_file(path, buf.getvalue())


def _write_file(path: Path, text: str) -> None:
    """text written atomically; gzip (one member) when the name ends in .gz, and then a stale plain
    copy of the same name is removed."""
    data = text.encode("utf-8")
    if is_gz(path):
        _write_atomic(path, _gzip_member(data))
        plain = _pair(path)[0]
        if plain.exists():
            plain.unlink()
    else:
        _write_atomic(path, data)


def write_json(path: PathLike, obj) -> None:
    """obj as JSON, written atomically (plain: indented, one aggregate row per line; .gz: compact, one
    gzip member, a stale plain copy removed). Large report summaries (compare/stronger tables) go
    compressed: every GPU transfer carries the tracked tree."""
    path = Path(path)
    _write_file(path, json.dumps(obj) if is_gz(path) else dumps_readable(obj))


def dumps_readable(obj) -> str:
    """Indented JSON whose lists of row dicts (aggregates) hold one row per line: readable in a diff
    and about a quarter smaller than indenting every field."""
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return "[\n" + ",\n".join(json.dumps(x) for x in obj) + "\n]"
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj, indent=1)
    items = (json.dumps(k) + ": " + dumps_readable(v).replace("\n", "\n ") for k, v in obj.items())
    return "{\n " + ",\n ".join(items) + "\n}"


def compress_folder(folder: PathLike, names: Iterable[str] = RAW_FILES) -> List[Tuple[str, int, int]]:
    """Migrate an older result folder once: write X.gz for every plain X of `names` (checked to
    decompress to the same bytes) and remove X. Returns (name, plain bytes, gz bytes) per file."""
    folder = Path(folder)
    done = []
    for name in names:
        plain, gz = _pair(folder / name)
        if not plain.exists():
            continue
        if gz.exists():
            raise MixedStore(f"both {plain} and {gz} exist: merge them first")
        with _locked(plain) as fd:  # appenders of the plain store wait, then see it gone
            data = plain.read_bytes()
            packed = _gzip_member(data)
            if gzip.decompress(packed) != data:
                raise RuntimeError(f"{plain}: the compressed copy does not read back")
            _write_atomic(gz, packed)
            plain.unlink()
        done.append((name, len(data), len(packed)))
    return done
