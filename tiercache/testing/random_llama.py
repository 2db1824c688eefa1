"""Builds small Llama checkpoints with context-sensitive random weights for e2e tests.

vLLM's ``load_format="dummy"`` fills every weight (norms included) with tiny
uniform values, so attention is flat and the next greedy token depends on the
current token only: a KV connector that loads garbage still yields the "right"
output. This module writes a real ``model.safetensors`` whose weights are
random but scaled from the config:

- RMSNorm weights are 1, so every normalised activation has rms ~1;
- q/k projections give attention scores with std ~``SCORE_STD`` (sharp
  attention: earlier tokens matter);
- v/o projections give an attention output of ~``ATTN_OUT_STD`` times the
  embedding scale (the residual stream does not drown it);
- the lm_head gives logits with std ~``LOGIT_STD`` (peaked, few near-ties);
- embeddings ~ N(0, 1); a fixed seed, so every engine process loads the
  same model.

The checkpoint is written in float32 (vLLM casts it to the requested dtype).
A stamp file records what was generated so repeated calls reuse the files.

Library: ``make_model_dir(name, out_root, seed)``.
CLI: ``python -m tiercache.testing.random_llama tiny /tmp/models [--seed N]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable

import torch

from tiercache.testing.random_lfm2 import build_lfm2_state_dict
from tiercache.testing.weight_recipe import (
    ATTN_MIX_GAIN,
    ATTN_OUT_STD,
    LOGIT_STD,
    SCORE_STD,
    weight_scales,
)

# Bump when the generation recipe changes so stale checkpoints are rebuilt.
RECIPE_VERSION = 3
STAMP_NAME = "tiercache_weights.stamp.json"
WEIGHTS_NAME = "model.safetensors"


PACKAGED_CONFIGS = pathlib.Path(__file__).resolve().parent / "model_configs"


def shared_models_dir() -> pathlib.Path:
    """The directory holding ``<name>/config.json`` (env TIERCACHE_SHARED_MODELS wins)."""
    override = os.environ.get("TIERCACHE_SHARED_MODELS")
    if override:
        return pathlib.Path(override)
    return pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "models"


def config_path(name: str) -> pathlib.Path:
    """``<shared>/models/<name>/config.json``, else the copy packaged with tiercache."""
    shared = shared_models_dir() / name / "config.json"
    if shared.is_file():
        return shared
    packaged = PACKAGED_CONFIGS / f"{name}.json"
    if packaged.is_file():
        return packaged
    raise FileNotFoundError(f"no model config named {name!r} (looked in {shared} and {packaged})")


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _layer_tensors(
    gen: torch.Generator, config: dict, scales: dict[str, float], layer: int
) -> dict[str, torch.Tensor]:
    d = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads", n_heads))
    head_dim = int(config.get("head_dim", d // n_heads))
    p = f"model.layers.{layer}."
    return {
        p + "self_attn.q_proj.weight": _normal(gen, (n_heads * head_dim, d), scales["q"]),
        p + "self_attn.k_proj.weight": _normal(gen, (n_kv * head_dim, d), scales["k"]),
        p + "self_attn.v_proj.weight": _normal(gen, (n_kv * head_dim, d), scales["v"]),
        p + "self_attn.o_proj.weight": _normal(gen, (d, n_heads * head_dim), scales["o"]),
        p + "mlp.gate_proj.weight": _normal(gen, (inter, d), scales["gate"]),
        p + "mlp.up_proj.weight": _normal(gen, (inter, d), scales["up"]),
        p + "mlp.down_proj.weight": _normal(gen, (d, inter), scales["down"]),
        p + "input_layernorm.weight": torch.ones(d, dtype=torch.float32),
        p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.float32),
    }


def build_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """All HF tensors for ``config`` (Llama, or LFM2 by its model_type), drawn from ``seed``."""
    if config.get("model_type") == "lfm2":
        return build_lfm2_state_dict(config, seed)
    gen = torch.Generator().manual_seed(seed)
    scales = weight_scales(config)
    d = int(config["hidden_size"])
    vocab = int(config["vocab_size"])
    tensors = {"model.embed_tokens.weight": _normal(gen, (vocab, d), scales["embed"])}
    for layer in range(int(config["num_hidden_layers"])):
        tensors.update(_layer_tensors(gen, config, scales, layer))
    tensors["model.norm.weight"] = torch.ones(d, dtype=torch.float32)
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = _normal(gen, (vocab, d), scales["lm_head"])
    return tensors


def _stamp(config_text: str, seed: int) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "config_sha1": hashlib.sha1(config_text.encode()).hexdigest(),
        "score_std": SCORE_STD,
        "attn_out_std": ATTN_OUT_STD,
        "attn_mix_gain": ATTN_MIX_GAIN,
        "logit_std": LOGIT_STD,
    }


def _read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomic(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(pathlib.Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def make_model_dir(name: str, out_root: pathlib.Path, seed: int = 1234) -> pathlib.Path:
    """Create (or reuse) ``out_root/<name>/`` holding config.json and random weights.

    Reuses the directory when its stamp matches the config, seed and recipe.
    """
    from safetensors.torch import save_file

    src = config_path(name)
    config_text = src.read_text()
    config = json.loads(config_text)
    model_dir = pathlib.Path(out_root) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    stamp = _stamp(config_text, seed)
    stamp_path = model_dir / STAMP_NAME
    weights = model_dir / WEIGHTS_NAME
    config_dst = model_dir / "config.json"
    if _read_json(stamp_path) == stamp and weights.is_file() and config_dst.is_file():
        return model_dir
    stamp_path.unlink(missing_ok=True)
    _write_atomic(config_dst, lambda p: shutil.copyfile(src, p))
    tensors = build_state_dict(config, seed)
    _write_atomic(weights, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write_atomic(stamp_path, lambda p: p.write_text(json.dumps(stamp, indent=1)))
    return model_dir


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: build one model directory and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="model name under the shared models dir or packaged (tiny, heavy, swa, lfm2)")
    parser.add_argument("out_root", type=pathlib.Path, help="where <name>/ is created")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    print(make_model_dir(args.name, args.out_root, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
