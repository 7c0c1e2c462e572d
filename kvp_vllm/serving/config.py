"""Server-wide eviction settings, the per-request budget rule, and the shipped-checkpoint lookup.

The settings travel from the `kvp-vllm` CLI to every vLLM process (API server, engine core, worker)
as JSON in the `KVP_VLLM_CONFIG` environment variable: child processes inherit it whether they are
forked or spawned, and the plugin reads it wherever vLLM loads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..scorers import SERVABLE_RULES
from ..selection import (DEFAULT_RECENT, DEFAULT_SINKS, BudgetError, check_budget, min_budget,  # noqa: F401
                         protect_mode)

ENV_VAR = "KVP_VLLM_CONFIG"
#: The rules the server accepts on the command line ("none" = plain vLLM), from the scorer registry:
#: every servable rule (`random` too, a floor for benchmarks); `oracle` needs the future and is refused.
CLI_RULES = ("none", "kvp", *(r for r in SERVABLE_RULES if r != "kvp"))
CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"
# Suffixes our asset converter (and common conversions) append to a model folder's name.
_NAME_SUFFIXES = ("-bf16", "-fp16", "-fp32", "-float32", "-bfloat16", "-safetensors", "-hf")


@dataclass(frozen=True)
class EvictionConfig:
    rule: str = "none"
    budget: Optional[int] = None       # server default tokens kept per KV head (None = no eviction)
    interval: int = 64                 # decode growth past the budget that triggers a re-compaction
    checkpoint: Optional[str] = None   # KVP policy folder (rule "kvp" only)
    # tokens every rule keeps whatever its scores (--protect: paper = 4 + 16, none = 0 + 0)
    n_sink: int = DEFAULT_SINKS
    n_recent: int = DEFAULT_RECENT

    @property
    def enabled(self) -> bool:
        return self.rule != "none"

    @property
    def min_budget(self) -> int:
        return min_budget(self.n_sink, self.n_recent)

    @property
    def protect(self) -> Optional[str]:
        """The --protect mode of n_sink / n_recent ("paper", "none"; None for other counts)."""
        return protect_mode(self.n_sink, self.n_recent)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ=os.environ) -> Optional["EvictionConfig"]:
        raw = environ.get(ENV_VAR)
        if not raw:
            return None
        return cls(**json.loads(raw))

    def validate(self) -> "EvictionConfig":
        if self.rule not in CLI_RULES:
            raise ValueError(f"unknown --kv-eviction rule {self.rule!r}; choose one of "
                             f"{', '.join(CLI_RULES)} (oracle is evaluation-only)")
        for name in ("n_sink", "n_recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
        if self.enabled:
            if self.budget is not None:
                check_budget(self.budget, self.n_sink, self.n_recent, what="--kv-budget")
        elif self.budget:
            raise ValueError("--kv-budget needs an eviction rule (--kv-eviction); got --kv-eviction none")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"--kv-evict-interval must be a positive integer; got {self.interval!r}")
        return self


def request_budget(extra_args: Optional[dict], cfg: EvictionConfig,
                   max_model_len: Optional[int] = None) -> Optional[int]:
    """The budget a request asks for: its `kv_budget` extra arg, else the server default.

    None means "no eviction for this request". Raises BudgetError for a value the API must refuse.
    Every process applies this same function, so the scheduler and the worker always agree.
    """
    if not extra_args or "kv_budget" not in extra_args:
        return cfg.budget if cfg.enabled else None
    value = extra_args["kv_budget"]
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    if not cfg.enabled:
        raise BudgetError("this server runs without KV eviction (--kv-eviction none); "
                          "kv_budget must be 0 or \"none\"")
    return check_budget(value, cfg.n_sink, cfg.n_recent, maximum=max_model_len, what="kv_budget",
                        allow_off=True)


def request_rule(extra_args: Optional[dict], cfg: EvictionConfig) -> str:
    """The scoring rule a request asks for (`vllm_xargs.kv_rule`), else the server's rule.

    Any servable rule may be picked per request (handy to compare rules on one server); `kvp` only
    when the server has a policy checkpoint. Raises BudgetError for a value the API must refuse.
    """
    if not extra_args or "kv_rule" not in extra_args:
        return cfg.rule
    value = extra_args["kv_rule"]
    allowed = [r for r in CLI_RULES if r != "none" and (r != "kvp" or cfg.checkpoint)]
    if not isinstance(value, str) or value not in allowed:
        hint = "" if cfg.checkpoint else " (kvp needs the server to be started with a policy checkpoint)"
        raise BudgetError(f"kv_rule must be one of {', '.join(allowed)}{hint}; got {value!r}")
    if not cfg.enabled:
        raise BudgetError("this server runs without KV eviction (--kv-eviction none); kv_rule is not "
                          "available")
    return value


def model_name_candidates(model: str) -> list[str]:
    """Folder names a shipped checkpoint for `model` may have: the repo/folder name, with the
    conversion suffixes dropped (".../SmolLM2-135M-Instruct-bf16" -> "SmolLM2-135M-Instruct")."""
    name = Path(str(model).rstrip("/")).name
    names = [name]
    for suffix in _NAME_SUFFIXES:
        if name.lower().endswith(suffix):
            names.append(name[: -len(suffix)])
    return names


def shipped_checkpoint(model: str, root: Path = CHECKPOINTS_DIR) -> Optional[Path]:
    for name in model_name_candidates(model):
        folder = root / name
        if (folder / "config.json").is_file() and (folder / "policy.safetensors").is_file():
            return folder
    return None


def resolve_checkpoint(model: str, checkpoint: Optional[str], root: Path = CHECKPOINTS_DIR) -> str:
    """The policy folder for `--kv-eviction kvp`: the explicit one, else the shipped one."""
    if checkpoint:
        if not Path(checkpoint).is_dir():
            raise FileNotFoundError(f"--kvp-checkpoint {checkpoint} is not a folder")
        return str(Path(checkpoint).resolve())
    found = shipped_checkpoint(model, root)
    if found is None:
        tried = ", ".join(str(root / n) for n in model_name_candidates(model))
        raise FileNotFoundError(
            f"--kv-eviction kvp needs a trained policy for {model}: no --kvp-checkpoint was given and "
            f"kvp-vllm ships none for this model (looked in {tried}). Train one with the kvp-vllm "
            f"training pipeline and pass --kvp-checkpoint PATH, or pick a training-free rule "
            f"(e.g. --kv-eviction snapkv)."
        )
    return str(found)
