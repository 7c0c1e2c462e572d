"""Bring a newly shipped policy's KVP rows into an existing kvp-eval folder, without recomputing them.

A policy is usually evaluated alone first (`kvp-eval --rules kvp --checkpoint NEW --out ..._policy_vN`);
once it ships, the big comparison folders should report it. Their prompts are the same (same harness
seed), so the rows are appended instead of recomputed:

  python benchmarks/import_policy_rows.py --source benchmarks/results/eval_smollm2_2k_policy_v6 \\
      --into benchmarks/results/eval_smollm2_2k_faithful_protect_paper [--tasks ppl_essay]
  kvp-eval ... --rules kvp --checkpoint auto --out <the same folder>   # computes nothing, rewrites the reports

The source's KVP rows (of the policy its results.json names) are appended only when both folders
evaluated the same prompts (every shared full-cache row agrees, `merge_rows`) with the same protect
mode; rows the folder already has are skipped, so a second run appends nothing. The folder's older KVP
rows stay in its store and are no longer reported (a folder reports one policy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvp_vllm.eval.runner import (FULL, RowMismatch, folder_policy_sha256, merge_rows, read_rows,  # noqa: E402
                                  row_key, stored_identity)
from kvp_vllm.eval.store import append_rows, store_path  # noqa: E402


def rows_to_import(source: Path, into: Path, tasks=None):
    """The source's KVP rows that `into` lacks; RowMismatch when the two folders' prompts differ."""
    protect = (stored_identity(into) or {}).get("protect")
    if protect != (stored_identity(source) or {}).get("protect"):
        raise RowMismatch(f"{source} and {into} were run with different --protect modes")
    sha = folder_policy_sha256(source)
    src = [r for r in read_rows(source / "rows.jsonl") if tasks is None or r["task"] in tasks]
    kvp = [r for r in src if r["rule"] == "kvp" and r.get("checkpoint_sha256") == sha]
    dst = read_rows(into / "rows.jsonl")
    merge_rows([r for r in dst if r["rule"] != "kvp"], [r for r in src if r["rule"] in (FULL, "kvp")],
               {"kvp": "kvp_imported"})  # raises RowMismatch unless the prompts are the same
    have = {row_key(r) for r in dst if r["rule"] == "kvp" and r.get("checkpoint_sha256") == sha}
    return [r for r in kvp if row_key(r) not in have]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="kvp-eval folder with the policy's KVP rows")
    p.add_argument("--into", type=Path, required=True, help="kvp-eval folder on the same prompts")
    p.add_argument("--tasks", default="", help="only these tasks (comma separated; default: all)")
    args = p.parse_args(argv)
    tasks = {t for t in args.tasks.split(",") if t} or None
    try:
        rows = rows_to_import(args.source, args.into, tasks)
    except (RowMismatch, FileNotFoundError, KeyError) as e:
        print(f"import_policy_rows: {e}", file=sys.stderr)
        return 2
    if rows:
        append_rows(store_path(args.into), rows)
    print(f"import_policy_rows: {len(rows)} KVP rows of policy {folder_policy_sha256(args.source)[:8]} appended to "
          f"{args.into}; rerun kvp-eval there with --rules kvp --checkpoint of that policy to rewrite its reports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
