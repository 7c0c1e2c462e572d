"""Result-folder files, plain, gzip- or xz-compressed: the rows store and the readers/writers around it.

A kvp-eval folder keeps its raw files compressed: `rows.jsonl.gz` (the resume store),
`progress.log.gz` and `per_sample.csv.gz`; older folders have the plain names, and every reader
accepts either (`find`, `open_text`, `read_rows`). The small summaries (results.json, aggregate.csv,
run.json) stay plain. A large finished store can be moved to xz (`compress_folder(..., XZ)`,
`kvp-eval --compress-store xz`): ~30% smaller than gzip on the 2K folders' rows (every GPU transfer
carries the tracked tree); it is read and appended to exactly like a .gz one, member for member.

Appending to a compressed store writes one member (a gzip member or an xz stream) per call; a file of
several is one stream for `zcat` / `xzcat` and Python's gzip / lzma modules (`zcat rows.jsonl.gz |
head` works). The end of a run rewrites the store as one member (`compact`), which compresses
~20-40% better than many small ones.

A write cut short (a crash, a killed process) leaves a truncated last member, as the plain store is
left with a partial last line. Reading keeps every complete line, also those of the cut member, and
drops the partial one, as for the plain store. The next append first cuts the damaged tail off and
rewrites its complete lines, so the rows appended after it are readable. Damage that is not a cut
tail (a corrupt byte in the middle) is never repaired silently: appending raises `StoreDamaged`.

A folder holds one store of a name: a plain `rows.jsonl` keeps being appended to (migrate it once
with `compress_folder`, or `kvp-eval --compress-store --out FOLDER`); a folder with two files of one
name (plain, .gz, .xz) is an error (`MixedStore`), never two stores read as one.
"""

from __future__ import annotations

import csv
import fcntl
import gzip
import io
import json
import lzma
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

GZ, XZ = ".gz", ".xz"
CODECS = (GZ, XZ)  # compressed suffixes; a new store is GZ
RAW_FILES = ("rows.jsonl", "progress.log", "per_sample.csv")  # compressed in a result folder
_CHUNK = 1 << 16

PathLike = Union[str, Path]


class MixedStore(RuntimeError):
    """A folder holds two of X, X.gz, X.xz: two stores of one name."""


class StoreDamaged(RuntimeError):
    """A compressed store is corrupt before its end (not a write cut short): not repaired automatically."""


def codec(path: PathLike) -> Optional[str]:
    """GZ or XZ by the name's suffix; None for a plain file."""
    return next((c for c in CODECS if str(path).endswith(c)), None)


def _names(path: PathLike) -> List[Path]:
    """[X, X.gz, X.xz] for any of the three names."""
    path = Path(path)
    c = codec(path)
    plain = path.with_name(path.name[:-len(c)]) if c else path
    return [plain] + [plain.with_name(plain.name + c) for c in CODECS]


def find(path: PathLike) -> Optional[Path]:
    """The stored file for X, X.gz or X.xz (any of the names may be given): the one that exists, None
    if none; MixedStore if two do."""
    there = [p for p in _names(path) if p.exists()]
    if len(there) > 1:
        a, b = there[0].name, there[1].name
        raise MixedStore(f"both {a} and {b} are in {there[0].parent}: a folder holds one store of a name; "
                         f"merge their lines into one of them (e.g. `cat`, `zcat`, `xzcat` of both, "
                         f"compressed again) or remove the stale one")
    return there[0] if there else None


def store_path(folder: PathLike, name: str = "rows.jsonl") -> Path:
    """Where to append `name` in a folder: the existing plain file of an older folder, else name.gz."""
    found = find(Path(folder) / name)
    return found if found is not None else Path(folder) / (name + GZ)


# ---------------------------------------------------------------------------------------------
# Reading a multi-member gzip / multi-stream xz file member by member


def _decompressor(c: str):
    return zlib.decompressobj(wbits=31) if c == GZ else lzma.LZMADecompressor(format=lzma.FORMAT_XZ)


def _compress(text: bytes, c: str) -> bytes:
    """One member: gzip level 9 (no timestamp: same bytes for the same rows), or an xz stream (preset
    6 extreme: 18% smaller than preset 9 on the 2K folder's rows in a by-hand check, 8 MiB dictionary)."""
    if c == GZ:
        return gzip.compress(text, compresslevel=9, mtime=0)
    return lzma.compress(text, format=lzma.FORMAT_XZ, preset=6 | lzma.PRESET_EXTREME)


@dataclass
class _Scan:
    text: bytes          # decompressed bytes of the complete members
    good_end: int        # file offset just past the last complete member
    members: int         # complete members
    tail: bytes = b""    # what the damaged/cut member decompressed to before the damage
    damage: Optional[str] = None  # None, "cut" (truncated tail / zero padding) or "corrupt"


def _scan(data: Union[bytes, memoryview], start: int = 0, c: str = GZ) -> _Scan:
    view = memoryview(data)
    pos, members, out = start, 0, []
    while pos < len(view):
        if view[pos] == 0 and not bytes(view[pos:]).strip(b"\0"):  # zero bytes after the last member
            return _Scan(b"".join(out), pos, members, b"", "cut")
        d = _decompressor(c)
        parts, p = [], pos
        try:
            while not d.eof and p < len(view):
                chunk = view[p:p + _CHUNK]
                parts.append(d.decompress(chunk))
                p += len(chunk) - len(d.unused_data)
        except (zlib.error, lzma.LZMAError):
            return _Scan(b"".join(out), pos, members, b"".join(parts), "corrupt")
        if not d.eof:  # the data ended inside this member: a write cut short
            if c == GZ:  # (an xz decompressor has returned all it can already)
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
    """The (decompressed) content of X, X.gz or X.xz; b"" if none exists. A cut compressed tail gives
    what it decompresses to, as a plain file cut by a crash gives its bytes."""
    found = find(path)
    if found is None:
        return b""
    data = found.read_bytes()
    if not codec(found):
        return data
    s = _scan(data, c=codec(found))
    return s.text + s.tail


@contextmanager
def open_text(path: PathLike, newline: Optional[str] = None) -> Iterator[io.TextIOBase]:
    """Open X, X.gz or X.xz (any of the names may be given) for reading text: e.g.
    `with open_text(folder / "per_sample.csv", newline="") as f: csv.DictReader(f)`."""
    found = find(path)
    if found is None:
        raise FileNotFoundError(f"none of {', '.join(map(str, _names(path)))} exists")
    if codec(found):
        with io.TextIOWrapper(io.BytesIO(read_bytes(found)), encoding="utf-8", newline=newline) as f:
            yield f
    else:
        with open(found, newline=newline) as f:
            yield f


def read_rows(path: PathLike) -> List[Dict]:
    """The JSON lines of a rows store (rows.jsonl, .gz or .xz; [] if there is none). A line cut by
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
    """A CSV written by write_csv (X, X.gz or X.xz), as strings."""
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
    minutes per sample); cut a damaged tail off and return its complete lines (to be written again),
    after a newline if the intact text ends inside a line (a plain store's cut line, compressed as it
    was); raise StoreDamaged for corruption before the tail."""
    size = os.fstat(fd).st_size
    s = _scan(os.pread(fd, size, 0) if size else b"", c=codec(path))
    if s.damage == "corrupt":
        raise StoreDamaged(f"{path} is corrupt at byte {s.good_end} of {size} (not a write cut short): "
                           f"the rows before it read fine; keep `{'zcat' if codec(path) == GZ else 'xzcat'}` "
                           f"of the good part and remove the damaged bytes by hand")
    if s.damage == "cut":
        os.ftruncate(fd, s.good_end)
    end_line = b"\n" if s.text and not s.text.endswith(b"\n") else b""  # it stays unreadable, the rest not
    return end_line + _complete_lines(s.tail)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_text(path: PathLike, text: str) -> None:
    """Append under an exclusive lock (processes running disjoint --tasks may share one folder):
    one member to a .gz / .xz file, plain text otherwise. A partial last line or cut member left by a
    crash is dropped first (a cut member's complete lines are kept), so what is appended reads back."""
    path = Path(path)
    data = text.encode("utf-8")
    c = codec(path)
    with _locked(path) as fd:
        if c:
            data = _compress(_repair_tail(fd, path) + data, c)
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
    """Rewrite a compressed store of several members as one (atomically; the content is unchanged, a
    cut tail's partial line dropped). False when there was nothing to do."""
    path, c = Path(path), codec(path)
    if not c or not path.exists():
        return False
    with _locked(path) as fd:
        data = path.read_bytes()
        s = _scan(data, c=c)
        if s.damage == "corrupt":
            return False  # left for the next append to report
        if s.members <= 1 and s.damage is None:
            return False
        _write_atomic(path, _compress(s.text + _complete_lines(s.tail), c))
        return True


def filter_rows(path: PathLike, keep) -> int:
    """Rewrite a store (plain, .gz or .xz, atomically, under the append lock) with only the rows for
    which keep(row) is true; returns how many rows were dropped."""
    path = Path(path)
    with _locked(path):
        rows = read_rows(path)
        kept = [r for r in rows if keep(r)]
        if len(kept) != len(rows):
            text = _jsonl(kept).encode("utf-8")
            c = codec(path)
            _write_atomic(path, _compress(text, c) if c else text)
        return len(rows) - len(kept)


def write_csv(path: PathLike, rows: List[Dict], fields: Optional[List[str]] = None) -> None:
    """A CSV of the rows (fields: the given ones, else every key in order of appearance); compressed
    when the name ends in .gz / .xz, and then a stale copy under another of its names is removed."""
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
    """text written atomically; compressed (one member) when the name ends in .gz / .xz, and then a
    stale copy under another of its names (plain or the other codec) is removed."""
    data = text.encode("utf-8")
    if codec(path):
        _write_atomic(path, _compress(data, codec(path)))
        for other in _names(path):
            if other != path and other.exists():
                other.unlink()
    else:
        _write_atomic(path, data)


def write_json(path: PathLike, obj) -> None:
    """obj as JSON, written atomically (plain: indented, one aggregate row per line; .gz / .xz: compact,
    one member, a stale copy of another name removed). Large report summaries (compare/stronger
    tables) go compressed: every GPU transfer carries the tracked tree."""
    path = Path(path)
    _write_file(path, json.dumps(obj) if codec(path) else dumps_readable(obj))


def dumps_readable(obj) -> str:
    """Indented JSON whose lists of row dicts (aggregates) hold one row per line: readable in a diff
    and about a quarter smaller than indenting every field."""
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return "[\n" + ",\n".join(json.dumps(x) for x in obj) + "\n]"
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj, indent=1)
    items = (json.dumps(k) + ": " + dumps_readable(v).replace("\n", "\n ") for k, v in obj.items())
    return "{\n " + ",\n ".join(items) + "\n}"


def compress_folder(folder: PathLike, names: Iterable[str] = RAW_FILES,
                    to: str = GZ) -> List[Tuple[str, int, int]]:
    """Migrate a result folder's raw files once to codec `to` (GZ or XZ): write X.gz / X.xz for every
    plain X of `names`, or for X in the other codec (checked to decompress to the same bytes), and
    remove the old file. Returns (new name, uncompressed bytes, compressed bytes) per file."""
    if to not in CODECS:
        raise ValueError(f"unknown codec {to!r}; expected one of {', '.join(CODECS)}")
    folder = Path(folder)
    done = []
    for name in names:
        old = find(folder / name)  # MixedStore if two of its names exist
        if old is None or codec(old) == to:
            continue
        new = folder / (name + to)
        with _locked(old):  # migrate between runs: a run appending meanwhile would start a new store
            data = read_bytes(old)
            packed = _compress(data, to)
            if _scan(packed, c=to).text != data:
                raise RuntimeError(f"{old}: the compressed copy does not read back")
            _write_atomic(new, packed)
            old.unlink()
        done.append((new.name, len(data), len(packed)))
    return done
