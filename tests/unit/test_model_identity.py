"""The checkpoint and attention identities that the key namespace covers (connector/model_identity.py)."""

from __future__ import annotations

import json
import pathlib
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("safetensors")

from tiercache.connector.model_identity import (  # noqa: E402
    attention_identity,
    attention_identity_fields,
    identity_digest,
    model_identity,
    model_identity_fields,
)
from tiercache.testing.random_llama import WEIGHTS_NAME, make_model_dir  # noqa: E402


def vllm_config(model: str | pathlib.Path, load: dict[str, Any] | None = None, **model_settings: Any) -> Any:
    settings: dict[str, Any] = {
        "model": str(model), "revision": None, "dtype": torch.float32, "quantization": None,
        "quantization_config": None, "hf_overrides": {}, "seed": 0, "model_impl": "auto",
        "runner_type": "generate", "convert_type": "none", "trust_remote_code": False, "code_revision": None,
        "disable_sliding_window": False, "model_weights": "", "model_class_overrides": {}, "hf_config_path": None,
    }
    settings.update(model_settings)
    return SimpleNamespace(
        model_config=SimpleNamespace(**settings),
        load_config=SimpleNamespace(**{"load_format": "auto", "download_dir": None, **(load or {})}),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto", kv_cache_layout="LBHNC"),
    )


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    return make_model_dir("tiny", tmp_path / "models", seed=1)


def rewrite(model_dir: pathlib.Path, seed: int) -> None:
    """Write another checkpoint of the same config into the same directory (same names, same sizes)."""
    make_model_dir("tiny", model_dir.parent, seed=seed)


def test_same_path_different_weights_is_another_model(model_dir: pathlib.Path) -> None:
    first = model_identity_fields(vllm_config(model_dir))
    size = (model_dir / WEIGHTS_NAME).stat().st_size
    rewrite(model_dir, seed=2)
    second = model_identity_fields(vllm_config(model_dir))
    assert (model_dir / WEIGHTS_NAME).stat().st_size == size
    assert first["weight_files"] == second["weight_files"]  # names and sizes cannot tell them apart
    assert first["config"] == second["config"]
    assert first["weight_content"] != second["weight_content"]
    assert model_identity(vllm_config(model_dir)) != identity_digest(first)


def test_the_same_checkpoint_rewritten_or_copied_is_the_same_model(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    first = model_identity(vllm_config(model_dir))
    rewrite(model_dir, seed=2)
    assert model_identity(vllm_config(model_dir)) != first
    rewrite(model_dir, seed=1)
    assert model_identity(vllm_config(model_dir)) == first  # content, not mtimes
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(model_dir, copy)
    assert model_identity(vllm_config(copy)) == first  # content, not the path


@pytest.mark.parametrize(
    "change",
    [
        {"hf_overrides": {"rope_theta": 20000.0}},
        {"quantization": "fp8"},
        {"dtype": torch.bfloat16},
        {"revision": "abc123"},
        {"disable_sliding_window": True},
        {"model_impl": "transformers"},
    ],
)
def test_settings_that_change_the_forward_pass_change_the_identity(model_dir: pathlib.Path, change: dict) -> None:
    assert model_identity(vllm_config(model_dir)) != model_identity(vllm_config(model_dir, **change))


def test_a_callable_override_is_named_stably(model_dir: pathlib.Path) -> None:
    def override(cfg: Any) -> Any:
        return cfg

    a = model_identity_fields(vllm_config(model_dir, hf_overrides=override))
    b = model_identity_fields(vllm_config(model_dir, hf_overrides=override))
    assert a == b and "0x" not in a["hf_overrides"]
    assert a["hf_overrides"] != model_identity_fields(vllm_config(model_dir))["hf_overrides"]


def test_dummy_weights_depend_on_the_seed(model_dir: pathlib.Path) -> None:
    dummy = {"load_format": "dummy"}
    assert model_identity(vllm_config(model_dir, load=dummy, seed=1)) != model_identity(
        vllm_config(model_dir, load=dummy, seed=2))
    assert model_identity(vllm_config(model_dir)) == model_identity(vllm_config(model_dir, seed=2))
    assert model_identity(vllm_config(model_dir)) != model_identity(vllm_config(model_dir, load=dummy))


def test_config_json_content_counts_not_its_path(model_dir: pathlib.Path) -> None:
    before = model_identity_fields(vllm_config(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    after = model_identity_fields(vllm_config(model_dir))
    assert before["config"] != after["config"] and before["weight_content"] == after["weight_content"]


def test_one_tensor_changed_at_its_end_is_seen(tmp_path: pathlib.Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"w{i}": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file(tensors, str(model / "model.safetensors"))
    first = model_identity_fields(vllm_config(model))
    tensors["w5"][-1, -1] += 1.0  # one element, last row of a middle tensor (added tokens, say)
    save_file(tensors, str(model / "model.safetensors"))
    second = model_identity_fields(vllm_config(model))
    assert first["weight_files"] == second["weight_files"]
    assert first["weight_content"] != second["weight_content"]


def test_other_weight_formats_are_sampled(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = bytearray(torch.randn(100_000, generator=torch.Generator().manual_seed(0)).numpy().tobytes())
    (model / "pytorch_model.bin").write_bytes(bytes(data))
    first = model_identity_fields(vllm_config(model))
    data[0] ^= 0xFF
    (model / "pytorch_model.bin").write_bytes(bytes(data))
    assert model_identity_fields(vllm_config(model))["weight_content"] != first["weight_content"]


def test_a_hub_name_without_local_files_falls_back_to_name_and_revision(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    fields = model_identity_fields(vllm_config("nobody/no-such-model", revision="v1"))
    assert fields["source"] == "name" and fields["name"] == "nobody/no-such-model" and fields["revision"] == "v1"
    assert model_identity(vllm_config("nobody/no-such-model", revision="v2")) != model_identity(
        vllm_config("nobody/no-such-model", revision="v1"))


# --------------------------------------------------------------------------- attention


def kv_cache_config(num_blocks: int, local_heads: int) -> Any:
    spec = SimpleNamespace(num_kv_heads=local_heads)
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)],
                           kv_cache_layout="LBHNC")


def kv_caches(num_blocks: int, heads: int, tokens: int = 32, content: int = 128, order: str = "BHNC",
              layers: int = 2) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer ``[B, H, N, C]`` views, laid out in memory in ``order``."""
    sizes = {"B": num_blocks, "H": heads, "N": tokens, "C": content}
    out = {}
    for layer in range(layers):
        phys = torch.zeros(*(sizes[d] for d in order))
        out[f"layer.{layer}"] = phys.permute(*(order.index(d) for d in "BHNC"))
    return out


def test_attention_identity_is_tp_invariant_but_sees_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.connector.model_identity as mi

    monkeypatch.setattr(mi, "_backend_names", lambda cfg: "CPU_ATTN")
    cfg = vllm_config("m")
    tp1 = attention_identity_fields(cfg, kv_cache_config(40, 2), kv_caches(40, 2))
    tp2 = attention_identity_fields(cfg, kv_cache_config(40, 1), kv_caches(40, 1))
    assert tp1 == tp2, (tp1, tp2)  # the heads a rank holds are its shard's business
    assert tp1["pages"] == "float32[B,H,32,128]/order=0123" and tp1["kernel_block_size"] == "32"
    hnd = attention_identity_fields(cfg, kv_cache_config(40, 2), kv_caches(40, 2, order="BNHC"))
    assert hnd["pages"] != tp1["pages"]
    kernel16 = attention_identity_fields(cfg, kv_cache_config(40, 2), kv_caches(80, 2, tokens=16))
    assert kernel16["kernel_block_size"] == "16" and kernel16["pages"] != tp1["pages"]
    scheduler = attention_identity_fields(cfg, kv_cache_config(40, 2))
    assert set(scheduler) < set(tp1) and all(tp1[k] == v for k, v in scheduler.items())
    assert attention_identity(cfg, kv_cache_config(40, 2), kv_caches(40, 2)) != attention_identity(
        cfg, kv_cache_config(40, 2), kv_caches(40, 2, order="BNHC"))


def test_attention_identity_sees_backend_and_kv_cache_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiercache.connector.model_identity as mi

    cfg = vllm_config("m")
    monkeypatch.setattr(mi, "_backend_names", lambda c: "CPU_ATTN")
    a = attention_identity(cfg, kv_cache_config(40, 2), kv_caches(40, 2))
    monkeypatch.setattr(mi, "_backend_names", lambda c: "FLASH_ATTN")
    assert attention_identity(cfg, kv_cache_config(40, 2), kv_caches(40, 2)) != a
    cfg.cache_config.cache_dtype = "fp8_e5m2"
    monkeypatch.setattr(mi, "_backend_names", lambda c: "CPU_ATTN")
    assert attention_identity(cfg, kv_cache_config(40, 2), kv_caches(40, 2)) != a
