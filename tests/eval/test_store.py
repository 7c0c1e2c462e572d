"""Result-folder files: the gzip and xz rows stores (append, resume after a cut write, compaction), the
plain store of older folders, and the readers that take any of the names. No model: fast."""

import gzip
import json
import lzma
import threading

import pytest

from kvp_vllm.eval import cli
from kvp_vllm.eval.store import (MixedStore, StoreDamaged, _scan, append_rows, compact, compress_folder,
                                 find, open_text, read_bytes, read_csv, read_rows, store_path, write_csv,
                                 dumps_readable, write_json)


# both compressed codecs: (suffix, a decompressor of every member / stream)
CODECS = pytest.mark.parametrize("suffix,decompress", [(".gz", gzip.decompress), (".xz", lzma.decompress)])


def rows(start, n):
    return [{"task": "t", "index": i, "output": f"answer {i} é", "correct": i % 2 == 0}
            for i in range(start, start + n)]


def text(rs):
    return "".join(json.dumps(r) + "\n" for r in rs).encode()


@CODECS
def test_compressed_store_appends_members_that_read_as_one_stream(tmp_path, suffix, decompress):
    path = tmp_path / f"rows.jsonl{suffix}"
    for k in range(3):
        append_rows(path, rows(10 * k, 10))
    want = rows(0, 10) + rows(10, 10) + rows(20, 10)
    assert read_rows(path) == want
    assert read_rows(tmp_path / "rows.jsonl") == want  # the plain name finds the compressed store
    assert decompress(path.read_bytes()) == text(want)  # plain gzip / lzma reads all members
    assert _scan(path.read_bytes(), c=suffix).members == 3
    assert compact(path) and _scan(path.read_bytes(), c=suffix).members == 1
    assert read_rows(path) == want and not compact(path)  # one member: nothing to do
    assert read_rows(tmp_path / "missing.jsonl") == []


def _cut_points(size, start):
    return sorted({start + 1, start + 5, start + 12, *range(start + 20, size, 37), size - 9, size - 1})


@CODECS
def test_a_cut_member_reads_like_a_cut_plain_line_and_the_next_append_survives(tmp_path, suffix, decompress):
    """A write cut short: every complete row stays, the partial one is dropped, and rows appended
    afterwards read back - the same for a .gz / .xz store and the plain store of older folders."""
    src = tmp_path / f"whole.jsonl{suffix}"
    append_rows(src, rows(0, 5))
    first_member = src.stat().st_size
    append_rows(src, rows(5, 40))
    data, full_text = src.read_bytes(), text(rows(0, 45))
    for cut in _cut_points(len(data), first_member):
        gz = tmp_path / f"cut{cut}" / f"rows.jsonl{suffix}"
        gz.parent.mkdir()
        gz.write_bytes(data[:cut])
        got = read_bytes(gz)
        assert full_text.startswith(got)  # what a cut member yields is a prefix of what was written
        plain = tmp_path / f"cut{cut}" / "plain.jsonl"
        plain.write_bytes(got)  # the plain store cut at the same place
        kept = read_rows(gz)
        assert kept == read_rows(plain)
        assert kept[:5] == rows(0, 5) and kept == rows(0, len(kept))  # earlier rows intact, in order
        append_rows(gz, rows(100, 3))
        append_rows(plain, rows(100, 3))
        assert read_rows(gz) == read_rows(plain) == kept + rows(100, 3)
        assert decompress(gz.read_bytes())  # repaired: a valid gzip / xz file again


def test_plain_store_cut_mid_line_keeps_the_next_rows(tmp_path):
    plain = tmp_path / "rows.jsonl"
    plain.write_bytes(text(rows(0, 3))[:-10])  # the third row cut
    assert read_rows(plain) == rows(0, 2)
    append_rows(plain, rows(3, 2))
    assert read_rows(plain) == rows(0, 2) + rows(3, 2)  # the new first row is not fused with the cut one


@CODECS
def test_zero_filled_tail_is_cut_and_corruption_before_the_end_is_not_repaired(tmp_path, suffix, decompress):
    path = tmp_path / f"rows.jsonl{suffix}"
    append_rows(path, rows(0, 4))
    with open(path, "ab") as f:
        f.write(b"\0" * 300)
    assert read_rows(path) == rows(0, 4)
    append_rows(path, rows(4, 1))
    assert read_rows(path) == rows(0, 5) and decompress(path.read_bytes()) == text(rows(0, 5))

    bad = tmp_path / "bad" / f"rows.jsonl{suffix}"
    bad.parent.mkdir()
    append_rows(bad, rows(0, 50))
    append_rows(bad, rows(50, 50))
    data = bytearray(bad.read_bytes())
    data[len(data) // 4] ^= 0xFF  # inside the first member
    bad.write_bytes(bytes(data))
    before = bad.read_bytes()
    assert read_rows(bad) == rows(0, len(read_rows(bad)))  # what decodes before the damage, no error
    with pytest.raises(StoreDamaged, match="not a write cut short"):
        append_rows(bad, rows(200, 1))
    assert bad.read_bytes() == before  # nothing truncated
    assert not compact(bad) and bad.read_bytes() == before


def test_one_store_per_name(tmp_path):
    assert store_path(tmp_path) == tmp_path / "rows.jsonl.gz"  # a new folder: compressed
    (tmp_path / "rows.jsonl").write_text(json.dumps({"a": 1}) + "\n")
    assert store_path(tmp_path) == tmp_path / "rows.jsonl"  # an older folder: keep its plain store
    assert find(tmp_path / "rows.jsonl.gz") == tmp_path / "rows.jsonl"
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    for call in (lambda: store_path(tmp_path), lambda: read_rows(tmp_path / "rows.jsonl")):
        with pytest.raises(MixedStore, match="both rows.jsonl and rows.jsonl.gz"):
            call()
    (tmp_path / "rows.jsonl").unlink()
    (tmp_path / "rows.jsonl.xz").write_bytes(lzma.compress(b"{}\n"))
    with pytest.raises(MixedStore, match="both rows.jsonl.gz and rows.jsonl.xz"):
        read_rows(tmp_path / "rows.jsonl.xz")
    (tmp_path / "rows.jsonl.gz").unlink()
    assert store_path(tmp_path) == tmp_path / "rows.jsonl.xz"  # a folder moved to xz: appended as xz
    assert read_rows(tmp_path / "rows.jsonl") == [{}]


def test_csv_gz_and_open_text(tmp_path):
    (tmp_path / "per_sample.csv").write_text("stale\n")
    rs = [{"a": 1, "b": "x, \"quoted\"\nline"}, {"a": 2, "b": "é"}]
    write_csv(tmp_path / "per_sample.csv.gz", rs)
    assert not (tmp_path / "per_sample.csv").exists()  # the stale plain copy goes
    assert read_csv(tmp_path / "per_sample.csv") == [{"a": "1", "b": rs[0]["b"]}, {"a": "2", "b": "é"}]
    write_csv(tmp_path / "aggregate.csv", rs)  # plain name: plain file, same bytes
    assert (tmp_path / "aggregate.csv").read_bytes() == gzip.decompress(
        (tmp_path / "per_sample.csv.gz").read_bytes())
    with open_text(tmp_path / "aggregate.csv") as f:
        assert f.readline().strip() == "a,b"
    with pytest.raises(FileNotFoundError):
        with open_text(tmp_path / "nothing.csv"):
            pass


def test_write_json_gz_replaces_a_stale_plain_copy(tmp_path):
    obj = {"aggregate": [{"rule": "kvp", "accuracy": 0.5}], "label": "é"}
    (tmp_path / "compare.json").write_text("stale")
    write_json(tmp_path / "compare.json.gz", obj)
    assert not (tmp_path / "compare.json").exists()
    assert json.loads(gzip.decompress((tmp_path / "compare.json.gz").read_bytes())) == obj
    write_json(tmp_path / "plain.json", obj)  # plain name: readable JSON, one aggregate row per line
    text = (tmp_path / "plain.json").read_text()
    assert json.loads(text) == obj and '{"rule": "kvp", "accuracy": 0.5}' in text.splitlines()[2]
    nested = {"a": {"b": [1, 2], "rows": [{"x": 1}, {"x": [2]}]}, "empty": {}, "none": None}
    assert json.loads(dumps_readable(nested)) == nested


def test_compress_folder_migrates_once_and_reads_back(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_bytes(text(rows(0, 20)) + b'{"cut')
    (tmp_path / "progress.log").write_text("12:00:00 sample 0\n")
    (tmp_path / "per_sample.csv").write_text("a\r\n1\r\n")
    (tmp_path / "aggregate.csv").write_text("kept plain\n")
    assert cli.main(["--compress-store", "--out", str(tmp_path)]) == 0
    assert "rows.jsonl.gz" in capsys.readouterr().err
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["aggregate.csv", "per_sample.csv.gz", "progress.log.gz", "rows.jsonl.gz"]
    assert gzip.decompress((tmp_path / "rows.jsonl.gz").read_bytes()) == text(rows(0, 20)) + b'{"cut'
    assert read_rows(tmp_path / "rows.jsonl") == rows(0, 20)
    assert compress_folder(tmp_path) == []  # nothing left to migrate

    # gz -> xz (a large finished folder): the same content, smaller; and back
    assert cli.main(["--compress-store", "xz", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["aggregate.csv", "per_sample.csv.xz", "progress.log.xz", "rows.jsonl.xz"]
    assert lzma.decompress((tmp_path / "rows.jsonl.xz").read_bytes()) == text(rows(0, 20)) + b'{"cut'
    assert read_rows(tmp_path / "rows.jsonl") == rows(0, 20) and read_csv(tmp_path / "per_sample.csv")
    append_rows(store_path(tmp_path), rows(20, 2))  # resuming appends to the xz store
    assert read_rows(tmp_path / "rows.jsonl.xz") == rows(0, 22)  # not fused with the cut line
    assert compress_folder(tmp_path, to=".xz") == []
    assert [n for n, _, _ in compress_folder(tmp_path, to=".gz")] == ["rows.jsonl.gz", "progress.log.gz",
                                                                     "per_sample.csv.gz"]
    assert read_rows(tmp_path / "rows.jsonl") == rows(0, 22)
    with pytest.raises(ValueError, match="unknown codec"):
        compress_folder(tmp_path, to=".bz2")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    with pytest.raises(MixedStore):
        compress_folder(tmp_path)


def test_concurrent_appends_and_compaction_lose_nothing(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    stop = threading.Event()

    def writer(w):
        for k in range(15):
            append_rows(path, [{"w": w, "k": k}])

    def compactor():
        while not stop.is_set():
            compact(path)

    c = threading.Thread(target=compactor)
    c.start()
    ws = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    c.join()
    got = read_rows(path)
    assert sorted((r["w"], r["k"]) for r in got) == [(w, k) for w in range(4) for k in range(15)]
    for w in range(4):
        assert [r["k"] for r in got if r["w"] == w] == list(range(15))  # each writer's order kept
