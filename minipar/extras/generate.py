"""Generating text with a trained model: a KV cache, and greedy, temperature and top-k sampling.

Training runs every position of a sequence at once. Generation adds one token at a time, and
without a cache each new token would recompute the keys and values of every token before it:
O(n^2) work for n tokens. The cache keeps each layer's keys and values (after RoPE) and feeds only
the new token through the model:

    prefill   the prompt, all at once: causal attention as in training; keys/values kept
    decode    one token: its query attends to every cached key (no mask needed: all are earlier)

The cache goes in through the seams the plain model leaves open (`attend` and `positions` of
each attention, model.py), so model.py knows nothing of it. `kv_cache(model)` installs it for the
length of a `with` block.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import repeat

from minipar.model import Llama
from minipar.ops import checkpoint_checks
from minipar.ops.args import inside
from minipar.run import checkpoint
from minipar.run.data import data_key, read_tokenizer


class KVCache:
    """Each layer's keys and values so far, [b, h_kv, seen, head_dim]."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def seen(self, layer: int) -> int:
        return self.keys[layer].shape[2] if layer in self.keys else 0

    def positions(self, local_len: int, device, layer: int) -> torch.Tensor:
        """The new tokens come after those already cached."""
        return self.seen(layer) + torch.arange(local_len, device=device)

    def attend(self, q, k, v, layer: int) -> torch.Tensor:
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        if q.shape[2] not in (1, k.shape[2]):
            raise ValueError("the cache takes a prompt at once, then one token at a time")
        group = q.shape[1] // k.shape[1]
        k, v = (repeat(t, "b h s d -> b (h g) s d", g=group) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)


@contextmanager
def kv_cache(model: Llama):
    """Install a fresh KVCache in every attention of the model for the block; restore after."""
    cache, saved = KVCache(), []
    for name, layer in model.layers.items():
        attn = layer.attn
        saved.append((attn, attn.attend, attn.positions))
        attn.attend = lambda q, k, v, i=int(name): cache.attend(q, k, v, i)
        attn.positions = lambda n, device, i=int(name): cache.positions(n, device, i)
    try:
        yield cache
    finally:
        for attn, attend, positions in saved:
            attn.attend, attn.positions = attend, positions


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator=None) -> torch.Tensor:
    """logits [b, V] -> [b]: the most likely token (temperature 0), or a draw from the softmax at
    `temperature`, among the top_k most likely only when top_k > 0."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Llama, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             generator=None, cache: bool = True) -> torch.Tensor:
    """prompt [b, s] -> [b, s + new_tokens]. cache=False recomputes the whole sequence each step
    (the reference the tests hold the cache to)."""
    tokens = prompt
    with kv_cache(model) if cache else nullcontext():
        logits = model(tokens)[:, -1]  # prefill
        for i in range(new_tokens):
            step = next_token(logits, temperature, top_k, generator)
            tokens = torch.cat([tokens, step[:, None]], dim=1)
            if i < new_tokens - 1:
                logits = model(step[:, None] if cache else tokens)[:, -1]  # decode: the new token only, if cached
    return tokens


# ----------------------------------------------------------------------------------------------
# A checkpoint on one process (scripts/tools/sample.py, scripts/tools/eval.py)
# ----------------------------------------------------------------------------------------------


def plain_model_from(path: Path) -> tuple[Llama, dict]:
    """The plain model holding a checkpoint's weights (any layout wrote it: tensors are stored at
    their single-device shapes), and the run's train state."""
    state = checkpoint_checks.verified(path)
    config = checkpoint_checks.model_config_of(path, state)
    with torch.device("meta"):  # no initialisation: every weight comes from the checkpoint
        model = Llama(config, seed=0)
    model = model.to_empty(device="cpu")
    if config.tie_embeddings:  # to_empty gave each module a new tensor of its own: share the table again
        model.lm_head.weight = model.tok_emb.weight
    checkpoint.load(path, model)
    return model.eval(), state


def run_config(state: dict, folder: Path | None) -> dict:
    """The run's settings saved in a checkpoint's train_state.json (a dict, or one line naming the file)."""
    if not isinstance(state.get("config"), dict):
        raise checkpoint.CheckpointError(f"checkpoint {folder}: its train_state.json holds no run settings "
                                         f"(\"config\"); use another checkpoint")
    return state["config"]


def tokenizer_path(state: dict, folder: Path | None = None) -> Path:
    """The tokenizer the run encoded its data with: the checkpoint's own copy (in `folder`), or,
    for a checkpoint saved before they kept one, the data cache's: a cache key from the state, which
    must name a folder inside the cache (train_state.json is not checksummed: never follow a `..`)."""
    if folder is not None and (folder / "tokenizer.json").exists():
        return folder / "tokenizer.json"
    run = run_config(state, folder)
    bpe = run.get("bpe_vocab", run.get("vocab_size"))  # runs before --bpe-vocab sized the BPE by --vocab-size
    key, cache = state.get("data_key") or data_key(run.get("data"), bpe), run.get("cache_dir")
    if not (isinstance(key, str) and isinstance(cache, str)):
        raise checkpoint.CheckpointError(f"checkpoint {folder}: its train_state.json names no data cache (cache_dir "
                                         f"{cache!r}, data_key {key!r}); give --tokenizer PATH")
    return inside(cache, key, f"checkpoint {folder}: train_state.json's data_key") / "tokenizer.json"


def checkpoint_tokenizer(state: dict, folder: Path, vocab_size: int, given: Path | None = None,
                         separator: bool = False):
    """`given` (--tokenizer), else the run's own (tokenizer_path); one line when there is none or
    its ids do not fit the model's `vocab_size` embedding rows. separator: as data.read_tokenizer."""
    path = given or tokenizer_path(state, folder)
    if given is None and not os.path.lexists(path):
        data = run_config(state, folder).get("data") or "the standard library"
        raise checkpoint.CheckpointError(
            f"checkpoint {folder} keeps no tokenizer (its run read token ids, --data {data}, without --tokenizer): "
            f"give --tokenizer PATH, the one those ids were made with" if str(data).endswith(".bin") else
            f"no tokenizer at {path}: train.py builds it from the run's --data ({data}); give --tokenizer PATH")
    tok = read_tokenizer(path, separator)
    own = folder / "tokenizer.json"  # what the weights were trained on: another one's ids mean other tokens
    if given is not None and own.exists() and read_tokenizer(own, separator).to_str() != tok.to_str():
        raise checkpoint.CheckpointError(f"--tokenizer {given} is not the tokenizer of {folder} (its ids would mean "
                                         f"other tokens to the model): leave --tokenizer out, the checkpoint keeps "
                                         f"its own")
    if tok.get_vocab_size() > vocab_size:
        raise checkpoint.CheckpointError(f"--tokenizer {path} has {tok.get_vocab_size()} tokens, more than the "
                                         f"model's vocabulary of {vocab_size}: give the tokenizer the model was "
                                         f"trained with")
    return tok
