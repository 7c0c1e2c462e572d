"""Remove the KVP rows of superseded policies from a kvp-eval folder's store, to keep the tracked tree small.

A folder reports one policy (`folder_policy_sha256`); rows of earlier policies stay in its store after a
new one is imported (`import_policy_rows.py`) and are no longer reported. They are kept in git history:
drop them here and note in the folder's README the commit that still has them
(`git checkout COMMIT -- FOLDER/rows.jsonl.gz` brings them back).

  python benchmarks/drop_policy_rows.py --folder benchmarks/results/eval_smollm2_2k_faithful_protect_paper \\
      --sha256 8c931e67,96bf1711

Each --sha256 is a prefix of a policy's weights sha256 (at least 8 hex digits). The folder's reported
policy is refused, as is a prefix that matches no row (a typo would otherwise drop nothing silently).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvp_vllm.eval.runner import folder_policy_sha256, read_rows  # noqa: E402
from kvp_vllm.eval.store import filter_rows, find  # noqa: E402


def drop_policy_rows(folder: Path, prefixes) -> int:
    """Drop the folder's KVP rows whose checkpoint sha256 starts with one of `prefixes`; the number dropped.
    ValueError for a short prefix, the reported policy, or a prefix no KVP row has."""
    store = find(Path(folder) / "rows.jsonl")
    if store is None:
        raise FileNotFoundError(f"no rows store in {folder}")
    reported = folder_policy_sha256(folder) or ""
    shas = {r.get("checkpoint_sha256") or "" for r in read_rows(store) if r["rule"] == "kvp"}
    for p in prefixes:
        if len(p) < 8:
            raise ValueError(f"sha256 prefix {p!r} is shorter than 8 hex digits")
        if reported.startswith(p):
            raise ValueError(f"{p} is the policy {folder} reports; its rows stay")
        if not any(s.startswith(p) for s in shas):
            raise ValueError(f"no KVP row of a policy {p}… in {store}")

    def keep(r):
        return r["rule"] != "kvp" or not (r.get("checkpoint_sha256") or "").startswith(tuple(prefixes))

    return filter_rows(store, keep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path, required=True, help="kvp-eval result folder")
    p.add_argument("--sha256", required=True, help="comma-separated sha256 prefixes of superseded policies")
    args = p.parse_args(argv)
    prefixes = [s.strip().lower() for s in args.sha256.split(",") if s.strip()]
    try:
        n = drop_policy_rows(args.folder, prefixes)
    except (ValueError, FileNotFoundError) as e:
        print(f"drop_policy_rows: {e}", file=sys.stderr)
        return 2
    print(f"drop_policy_rows: {n} KVP rows of {', '.join(prefixes)} dropped from {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
