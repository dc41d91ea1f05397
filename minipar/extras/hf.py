"""Hugging Face Llama checkpoints in and out: the same model under other names.

minipar's Llama and transformers' LlamaForCausalLM compute the same function (RMSNorm, RoPE that
rotates the pair (x_i, x_{i+hd/2}), grouped-query attention, SwiGLU), with their weights stored
the same way round ([out, in]). Only the names differ, and where the settings live:

    transformers  model.safetensors              minipar  model.safetensors
    model.embed_tokens.weight                    tok_emb.weight
    model.layers.i.input_layernorm.weight        layers.i.attn_norm.weight
    model.layers.i.self_attn.q_proj.weight       layers.i.attn.wq.weight      (k, v, o alike)
    model.layers.i.post_attention_layernorm...   layers.i.mlp_norm.weight
    model.layers.i.mlp.gate_proj.weight          layers.i.mlp.w_gate.weight   (up, down alike)
    model.norm.weight                            norm.weight
    lm_head.weight (absent when tied)            lm_head.weight (absent when tied)

    config.json {hidden_size, num_key_value_heads, rope_theta, rope_scaling, ...}  <->  ModelConfig

A checkpoint may be split over several files, listed in model.safetensors.index.json. This file
reads and writes them with safetensors and json only: transformers is needed to run the exported
model, never to convert it (scripts/tools/convert.py drives it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minipar.model import ModelConfig
from minipar.ops.args import inside
from minipar.run.paths import folder_path, regular_file

# (transformers name, minipar name); "{}" is the layer number.
NAMES = [("model.embed_tokens.weight", "tok_emb.weight"), ("model.norm.weight", "norm.weight"),
         ("lm_head.weight", "lm_head.weight")]
NAMES += [(f"model.layers.{{}}.{hf}.weight", f"layers.{{}}.{ours}.weight") for hf, ours in (
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
    ("self_attn.q_proj", "attn.wq"), ("self_attn.k_proj", "attn.wk"), ("self_attn.v_proj", "attn.wv"),
    ("self_attn.o_proj", "attn.wo"), ("mlp.gate_proj", "mlp.w_gate"), ("mlp.up_proj", "mlp.w_up"),
    ("mlp.down_proj", "mlp.w_down"))]
# config.json key -> ModelConfig field, for the settings that are one number each
CONFIG_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
               "intermediate_size": "ffn_dim", "vocab_size": "vocab_size", "rms_norm_eps": "norm_eps",
               "max_position_embeddings": "max_seq_len", "tie_word_embeddings": "tie_embeddings"}
SIZE_KEYS = [key for key in CONFIG_KEYS if key not in ("rms_norm_eps", "tie_word_embeddings")]  # required
SCALING_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_len"}


class HFError(ValueError):
    """A folder or config.json that is not a Llama checkpoint minipar can read; the message says why."""


def rename(name: str, to_minipar: bool = True) -> str:
    """One tensor's name in the other library's scheme."""
    for hf, ours in NAMES:
        source, target = (hf, ours) if to_minipar else (ours, hf)
        match = re.fullmatch(re.escape(source).replace(r"\{\}", r"(\d+)"), name)
        if match:
            return target.format(*match.groups())
    raise HFError(f"tensor {name} has no counterpart in a Llama model")


def config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a transformers LlamaConfig's config.json (4.x or 5.x keys)."""
    if hf.get("model_type") != "llama":
        raise HFError(f"model_type {hf.get('model_type')!r}, architectures {hf.get('architectures')}: "
                      f"only Llama (LlamaForCausalLM) checkpoints are supported")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}  # 4.x, 5.x
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"rope type {kind!r} is not supported (only default and llama3)")
    if kind == "llama3" and not SCALING_KEYS.keys() <= rope.keys():
        raise HFError(f"llama3 rope scaling without {', '.join(SCALING_KEYS.keys() - rope.keys())}")
    missing = [k for k in SIZE_KEYS if k not in hf]
    if missing:
        raise HFError(f"lacks {', '.join(missing)}")
    optional = [k for k in ("num_key_value_heads", "head_dim") if hf.get(k) is not None]  # null: derived
    bad = [f"{k} {hf[k]!r}" for k in (*SIZE_KEYS, *optional) if type(hf[k]) is not int or hf[k] < 1]
    if bad:
        raise HFError(f"{', '.join(bad)}: a size is a whole number, 1 or more")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)] + (
        [f"hidden_act {hf['hidden_act']}"] if hf.get("hidden_act", "silu") != "silu" else [])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        unsupported.append(f"head_dim {head_dim} x {hf['num_attention_heads']} heads != hidden_size")
    if unsupported:
        raise HFError(f"{', '.join(unsupported)}: not supported by minipar's Llama")
    values = {"norm_eps": 1e-6, **{ours: hf[key] for key, ours in CONFIG_KEYS.items() if key in hf}}  # 1e-6: theirs
    values["n_kv_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    values["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "llama3":
        values.update({ours: type(getattr(ModelConfig, ours))(rope[key]) for key, ours in SCALING_KEYS.items()})
    config = ModelConfig(**values)
    config.validate()  # heads that divide, a norm epsilon above 0 ...
    return config


def config_to_hf(c: ModelConfig) -> dict:
    """config.json for LlamaForCausalLM (the 4.x keys, which 5.x reads too)."""
    if c.n_experts:
        raise HFError("a mixture-of-experts model has no LlamaForCausalLM counterpart")
    hf = {key: getattr(c, ours) for key, ours in CONFIG_KEYS.items()}
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=c.n_kv_heads,
              head_dim=c.head_dim, rope_theta=c.rope_theta, hidden_act="silu", attention_bias=False,
              mlp_bias=False, bos_token_id=None, eos_token_id=None)
    if c.rope_factor != 1:
        hf["rope_scaling"] = {"rope_type": "llama3", **{key: getattr(c, ours) for key, ours in SCALING_KEYS.items()}}
    return hf


def read_json(path: Path) -> dict:
    """A JSON object from a file of the checkpoint, or HFError naming the file."""
    text = regular_file(path).read_bytes()  # InputError: a FIFO, a symlink loop
    try:
        value = json.loads(text)
    except ValueError as e:  # not UTF-8, not JSON
        raise HFError(f"{path} is not JSON ({str(e)[:200]}): download it again") from None
    if not isinstance(value, dict):
        raise HFError(f"{path} holds a JSON {type(value).__name__}, not an object: download it again")
    return value


def read_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    if not os.path.lexists(folder):
        raise HFError(f"{folder}: no such folder")
    folder_path(folder)  # a symlink loop, a file
    if not os.path.lexists(folder / "config.json"):
        raise HFError(f"{folder}: no config.json (a Hugging Face checkpoint folder holds config.json and "
                      f"*.safetensors)")
    hf = read_json(folder / "config.json")
    try:
        return config_from_hf(hf)
    except (TypeError, ValueError) as e:  # HFError, or a value of the wrong type (rope_scaling: "x")
        raise HFError(f"{folder / 'config.json'}: {e}") from None


def weight_files(folder: Path) -> dict[str, Path]:
    """transformers tensor name -> the .safetensors file holding it (one file, or an index of
    shards). Every file lies in the folder: an index naming `../elsewhere` is refused."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = read_json(index).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise HFError(f"{index}: its weight_map is not an object of tensor name -> file name")
        return {name: inside(folder, file, f"{index}: tensor {name}") for name, file in weight_map.items()}
    if not os.path.lexists(folder / "model.safetensors"):
        raise HFError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    with safetensors_of(folder / "model.safetensors") as f:
        return {name: folder / "model.safetensors" for name in f.keys()}


def safetensors_of(path: Path):
    """An open safetensors file, or HFError naming it (truncated, not safetensors, missing)."""
    try:
        return safe_open(regular_file(path), "pt")
    except (SafetensorError, OSError) as e:
        raise HFError(f"{path} is not a whole safetensors file ({str(e)[:200]}): download it again") from None


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, {minipar name: tensor}) from a transformers Llama folder. A tied checkpoint's
    lm_head.weight, if saved at all, must be the embedding again, and is dropped."""
    config, files = read_config(folder), weight_files(Path(folder))
    weights = {}
    for name, file in files.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived, not learned
        with safetensors_of(file) as f:
            try:
                weights[rename(name)] = f.get_tensor(name)
            except SafetensorError as e:  # a shard that lacks it, or cut short
                raise HFError(f"{file}: {name} cannot be read ({str(e)[:200]}): download it again") from None
    head = weights.pop("lm_head.weight", None) if config.tie_embeddings else None
    if head is not None and not torch.equal(head, weights.get("tok_emb.weight", head)):
        raise HFError(f"{folder}: config.json says tie_word_embeddings, but lm_head.weight in the files is not the "
                      f"embedding: set tie_word_embeddings to false in config.json to keep that head")
    return config, weights


def export_hf(config: ModelConfig, weights: dict[str, torch.Tensor], folder: str | Path) -> None:
    """config.json and model.safetensors, readable by LlamaForCausalLM.from_pretrained(folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = config_to_hf(config)
    tensors = {rename(name, to_minipar=False): t.contiguous() for name, t in weights.items()}
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
