"""The KVP policy: one small MLP per (layer, KV head), all stacked into batched weights so one batched
matmul scores every head at once, plus checkpoint I/O (safetensors weights + a JSON config).

Per head (PAPER.md):  key -> Linear -> LayerNorm;  value -> Linear -> LayerNorm;
                      position features -> Linear -> LayerNorm;
                      concat -> [Linear -> LayerNorm -> SiLU] x depth -> Linear -> score.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .assets import sha256_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "policy.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A policy checkpoint is missing, corrupt, or made for another model."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of the target model a policy is trained for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_name: str = ""

    @classmethod
    def from_hf_config(cls, config, model_name: str = "") -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(num_layers=config.num_hidden_layers,
                   num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
                   head_dim=head_dim, model_name=model_name or getattr(config, "name_or_path", ""))


@dataclass(frozen=True)
class PolicyConfig:
    """Architecture + feature settings + the target model's shape, all recorded in the checkpoint."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_name: str = ""
    key_dim: int = 32          # key projection width
    value_dim: int = 32        # value projection width
    pos_dim: int = 16          # position projection width
    pos_frequencies: int = 8   # sinusoid frequencies per log-position feature
    hidden_dim: int = 64
    depth: int = 2             # [Linear -> LayerNorm -> SiLU] blocks
    #: which position features the policy reads: "both" (log position and log distance from the newest
    #: token) or "distance" (distance only: a policy that cannot see absolute positions ranks recent
    #: text the same at 8K as at 2K; the absolute features' weights are held at zero)
    position_inputs: str = "both"

    def __post_init__(self) -> None:
        if self.position_inputs not in POSITION_INPUTS:
            raise ValueError(f"position_inputs must be one of {', '.join(POSITION_INPUTS)}; "
                             f"got {self.position_inputs!r}")

    @classmethod
    def small(cls, shape: ModelShape, **overrides) -> "PolicyConfig":
        """CPU-sized default (~14K parameters per head at head_dim 64)."""
        return cls(**_shape_kwargs(shape), **overrides)

    @classmethod
    def reference(cls, shape: ModelShape, **overrides) -> "PolicyConfig":
        """The paper's reference widths: 256-wide key/value paths, 32-wide position path, 256 hidden."""
        kw = dict(key_dim=256, value_dim=256, pos_dim=32, hidden_dim=256, depth=2)
        kw.update(overrides)
        return cls(**_shape_kwargs(shape), **kw)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.num_layers, self.num_kv_heads, self.head_dim, self.model_name)

    @property
    def num_position_features(self) -> int:
        return 2 + 2 * 2 * self.pos_frequencies


POSITION_INPUTS = ("both", "distance")


def absolute_position_features(frequencies: int) -> list:
    """Indices, in :func:`position_features`' layout, of the features of the absolute position (the
    rest describe the distance from the newest token): log, then sin and cos of each frequency."""
    f = frequencies
    return [0] + list(range(2, 2 + f)) + list(range(2 + 2 * f, 2 + 3 * f))


def _shape_kwargs(shape: ModelShape) -> dict:
    return dict(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim, model_name=shape.model_name)


def position_frequencies(frequencies: int, device=None) -> torch.Tensor:
    """The fp32 sinusoid frequencies [frequencies] of :func:`position_features`, log-spaced from 0.25
    to 8. One definition, shared by the policy and the fused kernels' launcher (kernels.pack_layer)."""
    return torch.exp(torch.linspace(math.log(0.25), math.log(8.0), frequencies, device=device,
                                    dtype=torch.float32))


def position_features(positions: torch.Tensor, length: int, frequencies: int) -> torch.Tensor:
    """Features [T, 2 + 4*frequencies] of each token's position and its distance from the newest one.

    Why not the paper's clamped Embedding(6000): every position past 6000 shares one row, so a
    policy cannot tell them apart on long prompts. We encode log(1 + position) and
    log(1 + distance from the end) with sinusoids plus the two raw log values. Log scale keeps every
    position distinct at any length while compressing far positions, so a policy trained at 2-4K
    sees inputs at 128K only modestly past its training range (log 131072 = 11.8 vs log 4096 = 8.3)
    rather than 32x past it, and the distance-from-end feature gives recency directly.
    """
    pos = positions.to(torch.float32)
    dist = (length - 1) - pos
    logs = torch.stack([torch.log1p(pos.clamp_min(0)), torch.log1p(dist.clamp_min(0))], dim=-1)  # [..., T, 2]
    freqs = position_frequencies(frequencies, device=pos.device)
    angles = logs[..., None] * freqs  # [..., T, 2, F]
    return torch.cat([logs / 10.0, angles.sin().flatten(-2), angles.cos().flatten(-2)], dim=-1)


class StackedLinear(nn.Module):
    """G independent Linear layers applied at once: x [G, T, in] -> [G, T, out]."""

    def __init__(self, groups: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_dim, out_dim))
        self.bias = nn.Parameter(torch.zeros(groups, 1, out_dim))
        bound = 1.0 / math.sqrt(in_dim)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, sel: slice = slice(None)) -> torch.Tensor:
        return torch.baddbmm(self.bias[sel], x, self.weight[sel])


class StackedLayerNorm(nn.Module):
    """G independent LayerNorms (own affine per group)."""

    def __init__(self, groups: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(groups, 1, dim))
        self.bias = nn.Parameter(torch.zeros(groups, 1, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, sel: slice = slice(None)) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight[sel] + self.bias[sel]


class KVPPolicy(nn.Module):
    """All (layer, KV head) scorers of one target model. Group g = layer * num_kv_heads + head."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.config = config
        g, c = config.num_layers * config.num_kv_heads, config
        self.key_proj, self.key_norm = StackedLinear(g, c.head_dim, c.key_dim), StackedLayerNorm(g, c.key_dim)
        self.value_proj, self.value_norm = (StackedLinear(g, c.head_dim, c.value_dim),
                                            StackedLayerNorm(g, c.value_dim))
        self.pos_proj, self.pos_norm = (StackedLinear(g, c.num_position_features, c.pos_dim),
                                        StackedLayerNorm(g, c.pos_dim))
        widths = [c.key_dim + c.value_dim + c.pos_dim] + [c.hidden_dim] * c.depth
        self.hidden = nn.ModuleList(StackedLinear(g, a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.hidden_norm = nn.ModuleList(StackedLayerNorm(g, c.hidden_dim) for _ in range(c.depth))
        self.out = StackedLinear(g, c.hidden_dim, 1)
        mask = torch.ones(c.num_position_features)
        if c.position_inputs == "distance":
            mask[absolute_position_features(c.pos_frequencies)] = 0.0
        self.register_buffer("position_mask", mask, persistent=False)
        self.zero_unread_position_weights()

    @torch.no_grad()
    def zero_unread_position_weights(self) -> None:
        """Zero the position-projection rows of features the config does not read. The features are
        masked in forward, so these rows get no gradient and stay zero, and the fused kernels (which
        compute every feature) multiply them by zero weights: the same scores."""
        self.pos_proj.weight[:, self.position_mask == 0, :] = 0.0

    @property
    def num_groups(self) -> int:
        return self.config.num_layers * self.config.num_kv_heads

    def forward(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                length: Optional[int] = None, groups: slice = slice(None)) -> torch.Tensor:
        """keys, values [G', T, head_dim] for the groups `groups` selects; positions [T] (shared) or
        [G', T]; length = the sequence length the positions belong to (default: max position + 1).
        Returns fp32 scores [G', T]."""
        dtype = self.key_proj.weight.dtype
        if length is None:
            length = int(positions.max()) + 1 if positions.numel() else 0
        pos = (position_features(positions, length, self.config.pos_frequencies) * self.position_mask).to(dtype)
        if pos.dim() == 2:
            pos = pos.expand(keys.shape[0], -1, -1)
        k = self.key_norm(self.key_proj(keys.to(dtype), groups), groups)
        v = self.value_norm(self.value_proj(values.to(dtype), groups), groups)
        p = self.pos_norm(self.pos_proj(pos, groups), groups)
        x = torch.cat([k, v, p], dim=-1)
        for lin, norm in zip(self.hidden, self.hidden_norm):
            x = F.silu(norm(lin(x, groups), groups))
        return self.out(x, groups).squeeze(-1).float()

    def score_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                    positions: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """One layer's scores: keys, values [kv_heads, T, head_dim] -> [kv_heads, T]."""
        c = self.config
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer {layer} out of range for a {c.num_layers}-layer policy")
        if keys.shape[0] != c.num_kv_heads or keys.shape[-1] != c.head_dim:
            raise ValueError(f"policy expects [{c.num_kv_heads} kv_heads, T, {c.head_dim}] keys; "
                             f"got {tuple(keys.shape)}")
        h = c.num_kv_heads
        return self.forward(keys, values, positions, length, slice(layer * h, (layer + 1) * h))

    def score_all(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  length: Optional[int] = None) -> torch.Tensor:
        """Every layer at once: keys, values [layers, kv_heads, T, d] -> [layers, kv_heads, T]."""
        l, h, t, d = keys.shape
        scores = self.forward(keys.reshape(l * h, t, d), values.reshape(l * h, t, d), positions, length)
        return scores.reshape(l, h, t)

    def num_parameters_per_head(self) -> int:
        return sum(p.numel() for p in self.parameters()) // self.num_groups

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike, extra: Optional[Dict] = None) -> Path:
        """Write policy.safetensors + config.json atomically (temporary names, then rename)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        fd, tmp_weights = tempfile.mkstemp(dir=folder, prefix=".policy-", suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp_weights, metadata={"format": "kvp-policy"})
        meta = {"format_version": FORMAT_VERSION, "architecture": asdict(self.config),
                "weights_sha256": sha256_file(Path(tmp_weights)), "extra": extra or {}}
        tmp_config = folder / ".config.json.tmp"
        tmp_config.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_weights, folder / WEIGHTS_NAME)
        os.replace(tmp_config, folder / CONFIG_NAME)
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike, expect: Optional[ModelShape] = None,
             map_location: str = "cpu") -> "KVPPolicy":
        """Load a checkpoint; with `expect`, refuse one trained for a model of another shape."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
        for p in (config_path, weights_path):
            if not p.is_file():
                raise CheckpointError(f"policy checkpoint {folder} has no {p.name}")
        try:
            meta = json.loads(config_path.read_text())
            arch = meta["architecture"]
            known = {f.name for f in fields(PolicyConfig)}
            unknown = set(arch) - known
            if unknown:
                raise CheckpointError(f"{config_path}: unknown architecture fields {sorted(unknown)}")
            config = PolicyConfig(**arch)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{config_path} is not a valid KVP policy config: {e}") from e
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{config_path}: format_version {meta.get('format_version')!r}, "
                                  f"this kvp-vllm reads {FORMAT_VERSION}")
        digest = sha256_file(weights_path)
        if digest != meta.get("weights_sha256"):
            raise CheckpointError(f"{weights_path} is corrupt or truncated: sha256 {digest} does not "
                                  f"match the {meta.get('weights_sha256')} recorded in {CONFIG_NAME}")
        if expect is not None:
            check_shape(config, expect, folder)
        try:
            tensors = load_file(str(weights_path), device=map_location)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{weights_path} cannot be read: {e}") from e
        policy = cls(config)
        try:
            policy.load_state_dict(tensors, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{weights_path} does not match its config: {e}") from e
        return policy.eval()

    @classmethod
    def random_init(cls, shape: ModelShape, seed: int = 0, reference: bool = False,
                    **overrides) -> "KVPPolicy":
        torch.manual_seed(seed)
        make = PolicyConfig.reference if reference else PolicyConfig.small
        return cls(make(shape, **overrides)).eval()


def check_shape(config: PolicyConfig, expect: ModelShape, where: object = "checkpoint") -> None:
    """Raise CheckpointError naming each mismatch between a policy and the model it is used with."""
    mismatches = [f"{name}: checkpoint {getattr(config, name)} vs model {getattr(expect, name)}"
                  for name in ("num_layers", "num_kv_heads", "head_dim")
                  if getattr(config, name) != getattr(expect, name)]
    if mismatches:
        raise CheckpointError(f"policy {where} was trained for {config.model_name or 'another model'} "
                              f"and does not fit {expect.model_name or 'this model'}: "
                              + "; ".join(mismatches))
