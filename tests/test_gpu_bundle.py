"""scripts/gpu_bundle.sh on a small payload: pack → verify → unpack round trip, and the failures that
must stop an install before anything is extracted (corrupt, missing or unknown parts, a damaged
manifest). No network; a few seconds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bundle.sh"
PART = "kvp-gpu-bundle.tar.xz.part-"
MARKER = ".kvp-gpu-bundle"


def run(*args, env=None):
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)],
        capture_output=True, text=True, timeout=120, env=env,
    )


def files_of(tree: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(tree)): p.read_bytes()
        for p in sorted(tree.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


@pytest.fixture
def payload(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (src / "pkg" / "sub" / "blob.bin").write_bytes(os.urandom(200 * 1024))
    (src / "other.bin").write_bytes(os.urandom(100 * 1024))
    (src / "pkg-1.0.dist-info").mkdir()
    (src / "pkg-1.0.dist-info" / "entry_points.txt").write_text("[x]\ny = pkg:z\n")
    (src / "empty").mkdir()
    return src


@pytest.fixture
def bundle(payload, tmp_path):
    out = tmp_path / "bundle"
    r = run("pack", payload, out, "--part-size-kib", 64)
    assert r.returncode == 0, r.stderr
    return out


def parts_of(out: Path) -> list[Path]:
    return sorted(out.glob(PART + "*"))


def assert_refused(r, *needles):
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr


def test_round_trip(payload, bundle, tmp_path):
    parts = parts_of(bundle)
    assert len(parts) >= 3
    assert all(p.stat().st_size == 64 * 1024 for p in parts[:-1])
    assert not (bundle / "kvp-gpu-bundle.tar.xz").exists()  # only the parts travel
    manifest = (bundle / "MANIFEST.sha256").read_text()
    for p in parts:
        assert p.name in manifest
    assert "# vllm: none" in manifest

    r = run("verify", bundle)
    assert r.returncode == 0, r.stderr

    target = tmp_path / "site"
    r = run("unpack", bundle, target)
    assert r.returncode == 0, r.stderr
    assert files_of(target) == files_of(payload)
    assert (target / "empty").is_dir()
    assert (target / MARKER).is_file()
    # no staging leftovers beside the target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "site", "src"]

    # unpacking again replaces a tree made by the script
    (target / "stale.txt").write_text("old")
    r = run("unpack", bundle, target)
    assert r.returncode == 0, r.stderr
    assert files_of(target) == files_of(payload)


def test_vllm_version_in_manifest(payload, tmp_path):
    meta = payload / "vllm-9.9.9.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    r = run("pack", payload, tmp_path / "b", "--part-size", 1)
    assert r.returncode == 0, r.stderr
    assert "# vllm: 9.9.9" in (tmp_path / "b" / "MANIFEST.sha256").read_text()
    assert len(parts_of(tmp_path / "b")) == 1


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_bad_part_stops_before_extracting(bundle, tmp_path, damage):
    victim = parts_of(bundle)[1]
    if damage == "corrupt":
        data = bytearray(victim.read_bytes())
        data[1000] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    assert_refused(run("verify", bundle), victim.name, damage)
    target = tmp_path / "site"
    assert_refused(run("unpack", bundle, target), victim.name, damage)
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "src"]


def test_truncated_manifest(bundle, tmp_path):
    man = bundle / "MANIFEST.sha256"
    lines = man.read_text().splitlines(keepends=True)
    man.write_text("".join(lines[:-3]))  # lost the last part, the archive line and the end marker
    target = tmp_path / "site"
    assert_refused(run("unpack", bundle, target), "MANIFEST.sha256", "truncated")
    assert not target.exists()


def test_manifest_missing_a_part_line(bundle):
    man = bundle / "MANIFEST.sha256"
    lines = man.read_text().splitlines(keepends=True)
    victim = next(i for i, line in enumerate(lines) if PART + "01" in line)
    man.write_text("".join(lines[:victim] + lines[victim + 1:]))
    # the part file is still there but no longer listed, and the count no longer matches
    r = run("verify", bundle)
    assert r.returncode != 0
    assert "truncated or damaged" in r.stderr or PART + "01" in r.stderr


def test_unknown_part(bundle, tmp_path):
    stray = bundle / (PART + "99")
    stray.write_bytes(b"from another build")
    target = tmp_path / "site"
    assert_refused(run("unpack", bundle, target), stray.name, "unknown part")
    assert not target.exists()


def test_manifest_with_foreign_name(bundle):
    man = bundle / "MANIFEST.sha256"
    text = man.read_text().replace(PART + "00", "../evil")
    man.write_text(text)
    assert_refused(run("verify", bundle), "unknown part", "../evil")


def test_missing_manifest(bundle):
    (bundle / "MANIFEST.sha256").unlink()
    assert_refused(run("verify", bundle), "MANIFEST.sha256")


def test_refuses_foreign_target(bundle, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert_refused(run("unpack", bundle, target), "refusing")
    assert (target / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["pack", "only-one"], ["verify"],
                                  ["build", "--part-size", "0"], ["build", "--bogus"],
                                  ["install"], ["unpack", "a"]])
def test_usage_on_bad_arguments(args):
    r = run(*args)
    assert r.returncode == 2
    assert "usage:" in r.stderr


def test_install_adds_kvp_vllm_with_its_plugin(bundle, payload, tmp_path):
    """install = unpack + kvp-vllm from this checkout, offline (smoke skipped: no CUDA vllm here)."""
    target = tmp_path / "site"
    env = dict(os.environ, PYTHON=sys.executable)
    r = run("install", bundle, "--target", target, "--no-smoke", env=env)
    assert r.returncode == 0, r.stderr
    assert f"export PYTHONPATH={target}" in r.stdout
    assert files_of(payload).items() <= files_of(target).items()
    (ep,) = target.glob("kvp_vllm-*.dist-info/entry_points.txt")
    assert "kvp_vllm = kvp_vllm.serving.plugin:register" in ep.read_text()
    assert (target / "kvp_vllm" / "serving" / "plugin.py").is_file()
    assert (target / "kvp_vllm" / "kernels").is_dir()
    found = subprocess.run(
        [sys.executable, "-c",
         "import sys; from importlib.metadata import distributions;"
         "print([e.value for d in distributions(path=[sys.argv[1]]) for e in d.entry_points"
         " if e.group == 'vllm.general_plugins'])", str(target)],
        capture_output=True, text=True, check=True,
    )
    assert "kvp_vllm.serving.plugin:register" in found.stdout
