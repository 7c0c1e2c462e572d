#!/usr/bin/env bash
# Offline vLLM bundle for air-gapped GPU hosts that already have torch 2.11.0+cu130 (see GPU.md §5).
#
# build    download the pinned wheels (scripts/gpu-slim-requirements.txt) for CPython 3.12 / manylinux
#          x86_64, install them into a tree, drop vLLM's optional kernel libraries that serving
#          Llama/Qwen2 on Hopper never loads, then pack the tree into checksummed parts.
# install  verify + reassemble + extract the parts into a target folder, install kvp-vllm itself from
#          this checkout into it (no network), check that vllm, its kernels and our plugin import.
# pack / verify / unpack   the pieces of build and install, usable on any folder.
#
# Nothing here touches the python environment itself: the result is a folder to put on PYTHONPATH.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQ="$ROOT/scripts/gpu-slim-requirements.txt"
PYTHON=${PYTHON:-python3}
WHEEL_CACHE=${KVP_GPU_WHEEL_CACHE:-${KVP_VLLM_CACHE:-$HOME/.cache/kvp-vllm}/gpu-wheels}
ARCHIVE=kvp-gpu-bundle.tar.xz
MANIFEST=MANIFEST.sha256
MARKER=.kvp-gpu-bundle          # written into every unpacked tree; lets unpack replace its own trees only
# manylinux_2_28 is vLLM's own floor; llguidance 1.7.6 ships only manylinux_2_31 (build warns about such).
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_31_x86_64)
# Host-provided packages that must never be in the tree (a second copy shadows the host's CUDA build).
FORBIDDEN_RE='^(torch|torchvision|torchaudio|torchcodec|triton|numpy|transformers|tokenizers|safetensors|nvidia[-_].*|cuda[-_].*)$'

USAGE="usage:
  $0 build   [--out DIR (.bundle)] [--part-size MiB (50)] [--python-version 3.12]
  $0 install DIR [--target DIR (/tmp/kvp-gpu-site)] [--no-smoke]
  $0 pack    SRC_DIR OUT_DIR [--part-size MiB (50) | --part-size-kib KiB]
  $0 verify  DIR
  $0 unpack  DIR TARGET
environment: PYTHON (python3) runs pip and the smoke check; KVP_GPU_WHEEL_CACHE (~/.cache/kvp-vllm/gpu-wheels)"

say() { echo "[gpu_bundle] $*" >&2; }
die() { echo "[gpu_bundle] error: $*" >&2; exit 1; }
usage() { [ $# -gt 0 ] && echo "[gpu_bundle] error: $*" >&2; echo "$USAGE" >&2; exit 2; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || usage "$1 needs a value"; }
posint() { [[ $2 =~ ^[1-9][0-9]*$ ]] || usage "$1 must be a positive integer, got '$2'"; }
human() { numfmt --to=iec-i --suffix=B --format=%.1f "$1"; }
fsize() { stat -c %s "$1"; }

# ---------------------------------------------------------------------------------------------- pack
# pack SRC OUT BYTES: OUT/kvp-gpu-bundle.tar.xz.part-NN + OUT/MANIFEST.sha256. The archive holds SRC's
# contents at its top level (extracting it reproduces SRC).
pack_dir() {
  local src=$1 out=$2 part_bytes=$3
  [ -d "$src" ] || die "pack: source folder '$src' does not exist"
  mkdir -p "$out"
  src=$(cd "$src" && pwd); out=$(cd "$out" && pwd)
  case "$out/" in "$src"/*) die "pack: output folder '$out' is inside the source '$src'";; esac
  rm -f "$out/$ARCHIVE" "$out/$ARCHIVE".part-* "$out/$MANIFEST"

  local vllm_version=none meta
  meta=$(ls -d "$src"/vllm-*.dist-info 2>/dev/null | head -1 || true)
  if [ -n "$meta" ] && [ -f "$meta/METADATA" ]; then
    vllm_version=$(sed -n 's/^Version: //p' "$meta/METADATA" | head -1)
  fi

  say "packing $src (tar | xz -6 -T0)"
  tar -C "$src" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -6 -T0 -c > "$out/$ARCHIVE"
  local total nparts digits
  total=$(fsize "$out/$ARCHIVE")
  nparts=$(( (total + part_bytes - 1) / part_bytes )); [ "$nparts" -ge 1 ] || nparts=1
  digits=${#nparts}; [ "$digits" -ge 2 ] || digits=2
  split -b "$part_bytes" -d -a "$digits" "$out/$ARCHIVE" "$out/$ARCHIVE.part-"

  local whole parts=("$out/$ARCHIVE".part-*)
  whole=$(sha256sum "$out/$ARCHIVE" | cut -d' ' -f1)
  {
    echo "# kvp-gpu-bundle manifest v1"
    echo "# vllm: $vllm_version"
    echo "# parts: ${#parts[@]}"
    echo "# archive-bytes: $total"
    (cd "$out" && sha256sum -- "${parts[@]##*/}")
    echo "$whole  $ARCHIVE"
    echo "# end"
  } > "$out/$MANIFEST.tmp"
  mv "$out/$MANIFEST.tmp" "$out/$MANIFEST"
  rm -f "$out/$ARCHIVE"

  say "wrote ${#parts[@]} part(s), $(human "$total") in all, vllm $vllm_version:"
  local p
  for p in "${parts[@]}"; do printf '  %-45s %12s  (%s)\n' "${p##*/}" "$(fsize "$p")" "$(human "$(fsize "$p")")"; done
  printf '  %-45s %12s  (%s)\n' "$MANIFEST" "$(fsize "$out/$MANIFEST")" "total archive $(human "$total")"
}

# -------------------------------------------------------------------------------------------- verify
# Parse + check DIR/MANIFEST.sha256; sets PART_FILES (in order), WHOLE_SHA, ARCHIVE_BYTES, BUNDLE_VLLM.
verify_dir() {
  local dir=$1 man
  [ -d "$dir" ] || die "bundle folder '$dir' does not exist"
  man="$dir/$MANIFEST"
  [ -f "$man" ] || die "$man is missing (not a bundle folder?)"
  local line header=0 end=0 nparts='' sha name
  PART_FILES=(); PART_SHAS=(); WHOLE_SHA=''; ARCHIVE_BYTES=''; BUNDLE_VLLM=''
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in
      "# kvp-gpu-bundle manifest v1") header=1 ;;
      "# vllm: "*) BUNDLE_VLLM=${line#"# vllm: "} ;;
      "# parts: "*) nparts=${line#"# parts: "} ;;
      "# archive-bytes: "*) ARCHIVE_BYTES=${line#"# archive-bytes: "} ;;
      "# end") end=1 ;;
      "") ;;
      "#"*) ;;
      *)
        [ "$end" = 0 ] || die "$man: line after '# end': $line"
        [[ $line =~ ^([0-9a-f]{64})\ [\ *](.+)$ ]] || die "$man: malformed line: $line"
        sha=${BASH_REMATCH[1]}; name=${BASH_REMATCH[2]}
        if [ "$name" = "$ARCHIVE" ]; then
          WHOLE_SHA=$sha
        elif [[ $name =~ ^${ARCHIVE//./\\.}\.part-[0-9]+$ ]]; then
          PART_FILES+=("$name"); PART_SHAS+=("$sha")
        else
          die "$man lists an unknown part '$name' (expected $ARCHIVE.part-NN)"
        fi ;;
    esac
  done < "$man"
  [ "$header" = 1 ] || die "$man: not a kvp-gpu-bundle manifest (first line missing)"
  [ "$end" = 1 ] || die "$man is truncated (no '# end' line): copy it again"
  [[ $nparts =~ ^[0-9]+$ ]] || die "$man is truncated or damaged (no '# parts:' line)"
  [[ $ARCHIVE_BYTES =~ ^[0-9]+$ ]] || die "$man is truncated or damaged (no '# archive-bytes:' line)"
  [ -n "$WHOLE_SHA" ] || die "$man is truncated or damaged (no sha256 line for $ARCHIVE)"
  [ "${#PART_FILES[@]}" = "$nparts" ] \
    || die "$man is truncated or damaged: it announces $nparts part(s) but lists ${#PART_FILES[@]}"
  local sorted
  sorted=$(printf '%s\n' "${PART_FILES[@]}" | sort -u)
  [ "$sorted" = "$(printf '%s\n' "${PART_FILES[@]}")" ] || die "$man lists parts twice or out of order"

  # A part file in DIR that the manifest does not list: parts of two builds are mixed.
  local f listed
  for f in "$dir/$ARCHIVE".part-*; do
    [ -e "$f" ] || continue
    listed=0
    for name in "${PART_FILES[@]}"; do
      if [ "${f##*/}" = "$name" ]; then listed=1; break; fi
    done
    [ "$listed" = 1 ] || die "unknown part ${f##*/} in $dir: not listed in $MANIFEST (parts of two builds mixed?)"
  done

  local i bad=() missing=() bytes=0 got
  for i in "${!PART_FILES[@]}"; do
    name=${PART_FILES[$i]}
    if [ ! -f "$dir/$name" ]; then missing+=("$name"); continue; fi
    got=$(sha256sum "$dir/$name" | cut -d' ' -f1)
    [ "$got" = "${PART_SHAS[$i]}" ] || bad+=("$name")
    bytes=$(( bytes + $(fsize "$dir/$name") ))
  done
  [ ${#missing[@]} = 0 ] || die "missing part(s) in $dir: ${missing[*]}"
  [ ${#bad[@]} = 0 ] || die "corrupt part(s) in $dir (sha256 mismatch): ${bad[*]}"
  [ "$bytes" = "$ARCHIVE_BYTES" ] || die "parts add up to $bytes bytes, manifest says $ARCHIVE_BYTES"
  say "verified ${#PART_FILES[@]} part(s) in $dir ($(human "$bytes"), vllm $BUNDLE_VLLM)"
}

# -------------------------------------------------------------------------------------------- unpack
# unpack_to DIR STAGE: verify, reassemble, check the whole archive, extract into the (empty) STAGE.
unpack_to() {
  local dir=$1 stage=$2
  verify_dir "$dir"
  local joined="$stage/.$ARCHIVE" name got
  for name in "${PART_FILES[@]}"; do cat "$dir/$name"; done > "$joined"
  got=$(sha256sum "$joined" | cut -d' ' -f1)
  [ "$got" = "$WHOLE_SHA" ] || die "reassembled $ARCHIVE does not match its sha256 in $MANIFEST"
  say "extracting into a staging folder"
  tar -C "$stage" -xJf "$joined" --no-same-owner
  rm -f "$joined"
  printf 'kvp-gpu-bundle vllm=%s archive-sha256=%s\n' "$BUNDLE_VLLM" "$WHOLE_SHA" > "$stage/$MARKER"
}

# new_stage TARGET: a fresh folder beside TARGET (same filesystem, so the final move is a rename);
# refuses a TARGET that is a file or a non-empty folder not made by this script.
new_stage() {
  local target=$1 parent
  if [ -e "$target" ]; then
    [ -d "$target" ] || die "target '$target' exists and is not a folder"
    if [ -n "$(ls -A "$target")" ] && [ ! -f "$target/$MARKER" ]; then
      die "target '$target' is not empty and was not made by gpu_bundle.sh: refusing to replace it"
    fi
  fi
  parent=$(dirname "$target")
  mkdir -p "$parent"
  STAGE=$(mktemp -d "$parent/.$(basename "$target").staging.XXXXXX")
  CLEANUP+=("$STAGE")
}

# commit_stage TARGET: swap the staged tree in (the old tree, if any, is removed afterwards).
commit_stage() {
  local target=$1 old=''
  if [ -e "$target" ]; then
    old=$(mktemp -d "$(dirname "$target")/.$(basename "$target").old.XXXXXX")
    CLEANUP+=("$old")
    mv "$target" "$old/tree"
    say "replacing the previous tree in $target"
  fi
  mv "$STAGE" "$target"
  [ -z "$old" ] || rm -rf "$old"
}

CLEANUP=()
cleanup() { local d; for d in "${CLEANUP[@]}"; do if [ -e "$d" ]; then rm -rf "$d"; fi; done; return 0; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --------------------------------------------------------------------------------------------- build
trim_vllm() {
  local tree=$1 v="$1/vllm" removed=0 before after pat found f
  [ -d "$v" ] || die "no vllm package in $tree"
  before=$(du -sb "$tree" | cut -f1)
  # Optional kernel libraries; each is imported lazily or inside try/except ImportError by vLLM 0.32.0.
  local patterns=(
    "vllm_flash_attn/_vllm_fa2_C*.so"   # FlashAttention 2 (Ampere); Hopper uses _vllm_fa3_C
    "vllm-rs" "vllm_rs*"                # Rust frontend binary, only with VLLM_USE_RUST_FRONTEND
    "third_party/deep_gemm"             # DeepGEMM FP8 GEMMs (DeepSeek-style models)
    "third_party/fmha_sm100"            # Blackwell sparse-attention kernels
    "_qutlass_C*.so"                    # FP4 (needs symbols torch 2.11 lacks)
    "_flashkda_C*.so" "_deepselect_C*.so"
    "_flashmla*.so"                     # MLA attention (DeepSeek)
    "_moe_C*.so"                        # mixture-of-experts kernels
  )
  say "trimming optional vLLM kernel libraries:"
  for pat in "${patterns[@]}"; do
    found=0
    for f in "$v"/$pat; do
      [ -e "$f" ] || continue
      found=1
      printf '  - %-45s %s\n' "${f#"$tree"/}" "$(human "$(du -sb "$f" | cut -f1)")" >&2
      rm -rf "$f"
    done
    [ "$found" = 1 ] || [ "$pat" = "vllm_rs*" ] || say "  (nothing matched vllm/$pat; wheel layout changed?)"
  done
  after=$(du -sb "$tree" | cut -f1)
  say "trimmed $(human $((before - after))); tree is now $(human "$after")"
  # Keep RECORD truthful so importlib.metadata / pip see only files that exist.
  "$PYTHON" - "$tree" <<'EOF'
import csv, glob, io, os, sys
tree = sys.argv[1]
for rec in glob.glob(os.path.join(tree, "vllm-*.dist-info", "RECORD")):
    rows = list(csv.reader(open(rec, newline="")))
    keep = [r for r in rows if r and os.path.lexists(os.path.join(tree, r[0]))]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(keep)
    open(rec, "w", newline="").write(out.getvalue())
EOF
}

check_tree() {
  local tree=$1 bad=() d name
  for d in "$tree"/*.dist-info; do
    name=$(sed -n 's/^Name: //p' "$d/METADATA" | head -1 | tr 'A-Z_.' 'a-z--')
    if [[ $name =~ $FORBIDDEN_RE ]]; then bad+=("$name"); fi
  done
  for d in torch triton numpy transformers; do if [ -e "$tree/$d" ]; then bad+=("$d/"); fi; done
  [ ${#bad[@]} = 0 ] || die "the tree contains host packages (two copies would break the host): ${bad[*]}"
  compgen -G "$tree/vllm/_C*.so" >/dev/null || die "the tree has no vllm/_C*.so"
  compgen -G "$tree/vllm/vllm_flash_attn/_vllm_fa3_C*.so" >/dev/null \
    || die "the tree has no vllm/vllm_flash_attn/_vllm_fa3_C*.so (FlashAttention 3, needed on Hopper)"
}

cmd_build() {
  local out="$ROOT/.bundle" mib=50 pyver=3.12
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) need_value "$@"; out=$2; shift 2 ;;
      --part-size) need_value "$@"; posint "$1" "$2"; mib=$2; shift 2 ;;
      --python-version) need_value "$@"; [[ $2 =~ ^3\.[0-9]+$ ]] || usage "--python-version wants 3.N"; pyver=$2; shift 2 ;;
      *) usage "build: unknown argument '$1'" ;;
    esac
  done
  [ -f "$REQ" ] || die "$REQ is missing"
  "$PYTHON" -m pip --version >/dev/null 2>&1 || die "'$PYTHON -m pip' does not work (set PYTHON=...)"
  local target_flags=(--only-binary=:all: --python-version "$pyver" --implementation cp)
  local p; for p in "${PLATFORMS[@]}"; do target_flags+=(--platform "$p"); done

  mkdir -p "$WHEEL_CACHE" "$out"
  exec 9>"$out/.build.lock"
  flock -n 9 || die "another build is writing $out (lock $out/.build.lock)"
  local npins; npins=$(grep -cvE '^\s*(#|$)' "$REQ")
  # Offline first: a rerun with every wheel cached needs no network.
  if env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
       "$PYTHON" -m pip download -q --no-deps --no-index --find-links "$WHEEL_CACHE" -d "$WHEEL_CACHE" \
       "${target_flags[@]}" -r "$REQ" >/dev/null 2>&1; then
    say "all $npins pinned wheels are in $WHEEL_CACHE"
  else
    say "downloading $npins pinned wheels for CPython $pyver manylinux x86_64 into $WHEEL_CACHE"
    if ! "$PYTHON" -m pip download --no-deps -d "$WHEEL_CACHE" "${target_flags[@]}" -r "$REQ"; then
      local failed=() pin
      while read -r pin; do
        "$PYTHON" -m pip download -q --no-deps -d "$WHEEL_CACHE" "${target_flags[@]}" "$pin" >/dev/null 2>&1 \
          || failed+=("$pin")
      done < <(grep -vE '^\s*(#|$)' "$REQ")
      [ ${#failed[@]} -gt 0 ] || failed=("(see the pip message above)")
      die "could not download: ${failed[*]}"
    fi
  fi

  # Wheels that need a newer glibc than vLLM's own manylinux_2_28 (check the host's `ldd --version`).
  local newer
  newer=$(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install \
            --dry-run --quiet --report - --no-deps --no-index --find-links "$WHEEL_CACHE" --target "$out/.dry" \
            "${target_flags[@]}" -r "$REQ" 2>/dev/null \
          | "$PYTHON" -c 'import json,re,sys
for i in json.load(sys.stdin)["install"]:
    name = i["download_info"]["url"].rsplit("/", 1)[-1]
    tags = [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)", name)]
    if tags and min(tags) > (2, 28): print(name)' || true)
  rm -rf "$out/.dry"
  [ -z "$newer" ] || say "note: these wheels need glibc newer than 2.28 on the host: $(echo $newer)"

  local tree
  tree=$(mktemp -d "$out/.tree.XXXXXX")
  CLEANUP+=("$tree")
  chmod 755 "$tree"   # the archive's top entry: the mode the target folder gets
  say "installing the wheels into $tree (no deps, no index, no bytecode)"
  # Hermetic: only the wheel cache, no pip config (it may add find-links or constraints).
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$PYTHON" -m pip install -q --no-deps --no-index --find-links "$WHEEL_CACHE" --no-compile \
      --target "$tree" "${target_flags[@]}" -r "$REQ" \
    || die "pip could not install the cached wheels into $tree"
  # Console scripts carry this machine's python in their shebang: useless on the GPU host.
  rm -rf "$tree/bin"
  trim_vllm "$tree"
  check_tree "$tree"
  pack_dir "$tree" "$out" $((mib * 1024 * 1024))
  say "done. copy $out/$MANIFEST and the parts to the GPU host, then run there:"
  say "  PYTHON=/opt/torch/.venv/bin/python3 scripts/gpu_bundle.sh install $(basename "$out") --target /tmp/kvp-gpu-site"
}

# ------------------------------------------------------------------------------------------- install
smoke() {
  local target=$1
  say "smoke check: PYTHONPATH=$target $PYTHON -c 'import torch, vllm, vllm._C_stable_libtorch; ...'"
  # from / : the cwd comes first on sys.path, and a source checkout (with the egg-info pip's in-tree
  # build leaves there) would shadow the installed kvp-vllm
  (cd / && PYTHONPATH="$target" "$PYTHON" - "$target") <<'EOF'
import os, sys
target = os.path.realpath(sys.argv[1])
import torch
import vllm
import vllm._C_stable_libtorch  # vLLM's CUDA "_C": registers torch.ops._C*
from importlib.metadata import distribution, entry_points
from vllm.vllm_flash_attn import flash_attn_interface as fa

def inside(path):
    return os.path.realpath(path).startswith(target + os.sep)

problems = []
if not inside(vllm.__file__):
    problems.append(f"vllm was imported from {vllm.__file__}, not from {target}")
if inside(torch.__file__):
    problems.append(f"torch was imported from the bundle ({torch.__file__}); it must come from the host")
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvp_vllm"]
if not eps or eps[0].value != "kvp_vllm.serving.plugin:register":
    problems.append("entry point vllm.general_plugins:kvp_vllm is missing")
elif not inside(str(distribution("kvp-vllm").locate_file("kvp_vllm"))):
    problems.append("the kvp-vllm found first is not the one in the target")
import kvp_vllm.kernels, kvp_vllm.serving.plugin  # the installed package is complete (kernels mapped)
if not inside(kvp_vllm.kernels.__file__):
    problems.append(f"kvp_vllm was imported from {kvp_vllm.kernels.__file__}, not from {target}")
if not fa.FA3_AVAILABLE:
    problems.append(f"FlashAttention 3 did not load: {fa.FA3_UNAVAILABLE_REASON}")
print(f"[gpu_bundle] smoke: vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}; "
      f"torch {torch.__version__}; FA3 {fa.FA3_AVAILABLE}; plugin {eps[0].value if eps else None}",
      file=sys.stderr)
if problems:
    sys.exit("[gpu_bundle] smoke check failed:\n  " + "\n  ".join(problems))
EOF
}

cmd_install() {
  local dir='' target=/tmp/kvp-gpu-site run_smoke=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --target) need_value "$@"; target=$2; shift 2 ;;
      --no-smoke) run_smoke=0; shift ;;
      -*) usage "install: unknown option '$1'" ;;
      *) [ -z "$dir" ] || usage "install: one bundle folder only"; dir=$1; shift ;;
    esac
  done
  [ -n "$dir" ] || usage "install: which bundle folder?"
  "$PYTHON" -m pip --version >/dev/null 2>&1 || die "'$PYTHON -m pip' does not work (set PYTHON=...)"
  target=$(realpath -m "$target")
  new_stage "$target"
  unpack_to "$dir" "$STAGE"
  say "installing kvp-vllm from $ROOT (no deps, no index, no build isolation)"
  (cd "$ROOT" && env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
     "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index --target "$STAGE" .) \
    || die "pip could not install kvp-vllm from $ROOT into the bundle (needs setuptools in $PYTHON's environment)"
  [ "$run_smoke" = 0 ] || smoke "$STAGE" || die "smoke check failed; nothing was installed in $target (--no-smoke skips it)"
  commit_stage "$target"
  say "installed into $target. Use it with:"
  echo "export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
}

cmd_unpack() {
  [ $# = 2 ] || usage "unpack wants DIR TARGET"
  local target; target=$(realpath -m "$2")
  new_stage "$target"
  unpack_to "$1" "$STAGE"
  commit_stage "$target"
  say "unpacked into $target"
}

cmd_pack() {
  local src='' out='' bytes=$((50 * 1024 * 1024))
  while [ $# -gt 0 ]; do
    case "$1" in
      --part-size) need_value "$@"; posint "$1" "$2"; bytes=$(($2 * 1024 * 1024)); shift 2 ;;
      --part-size-kib) need_value "$@"; posint "$1" "$2"; bytes=$(($2 * 1024)); shift 2 ;;
      -*) usage "pack: unknown option '$1'" ;;
      *) if [ -z "$src" ]; then src=$1; elif [ -z "$out" ]; then out=$1; else usage "pack: too many arguments"; fi; shift ;;
    esac
  done
  [ -n "$src" ] && [ -n "$out" ] || usage "pack wants SRC_DIR OUT_DIR"
  pack_dir "$src" "$out" "$bytes"
}

[ $# -ge 1 ] || usage
cmd=$1; shift
case "$cmd" in
  build) cmd_build "$@" ;;
  install) cmd_install "$@" ;;
  pack) cmd_pack "$@" ;;
  verify) [ $# = 1 ] || usage "verify wants DIR"; verify_dir "$1" ;;
  unpack) cmd_unpack "$@" ;;
  -h|--help|help) echo "$USAGE" ;;
  *) usage "unknown command '$cmd'" ;;
esac
