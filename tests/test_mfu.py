"""The FLOPs behind every MFU figure follow the published convention (PaLM appendix B, torchtitan):
6 x (N - input embedding parameters) + 12 x layers x dim x seq, the output projection counted, a
tied [V, d] matrix counted once (as the output projection).

Each expected figure is computed here from outside the function: the real models' parameter counts
as released (Llama-3.2-1B, tied: 1,235,814,400; Llama-3.1-8B, untied: 8,030,261,248; the sum of the
shapes their weights have) and, for the toy models, the parameters of a built module.
"""

import sys
from pathlib import Path

import pytest
import torch

from minipar.model import Llama, get_config

SEQ = 2048


def published(params: int, embedding_params: int, n_layers: int, dim: int, seq: int) -> int:
    """6 x non-embedding parameters + 12 x L x d x s: the formula as the PaLM appendix writes it."""
    return 6 * (params - embedding_params) + 12 * n_layers * dim * seq


def test_llama_3_2_1b_flops_are_the_published_formula_with_the_tied_table_counted_once():
    c = get_config("1b")
    assert c.tie_embeddings and c.num_params() == 1_235_814_400  # the preset is Llama-3.2-1B
    # Tied: the one [V, d] matrix is the output projection, a product, so nothing is left out.
    assert c.flops_per_token(SEQ) == published(1_235_814_400, 0, n_layers=16, dim=2048, seq=SEQ)


def test_llama_3_1_8b_flops_leave_out_the_input_embedding():
    c = get_config("8b")
    assert not c.tie_embeddings and c.num_params() == 8_030_261_248  # the preset is Llama-3.1-8B
    embedding = 128_256 * 4096  # the input table, a lookup; lm_head, the same size, stays in
    assert c.flops_per_token(SEQ) == published(8_030_261_248, embedding, n_layers=32, dim=4096, seq=SEQ)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_toy_model_flops_count_the_built_modules_parameters_less_the_lookup(tied):
    c = get_config("tiny", tie_embeddings=tied)
    model = Llama(c, seed=0)
    params = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter: counted once
    lookup = 0 if tied else model.tok_emb.weight.numel()
    assert c.flops_per_token(64) == published(params, lookup, c.n_layers, c.dim, 64)


def test_tying_changes_no_flops_only_the_parameters():
    """The same products run tied or untied: only the input lookup's table differs, and it is not counted."""
    tied, untied = get_config("8b", tie_embeddings=True), get_config("8b")
    assert untied.num_params() - tied.num_params() == 128_256 * 4096
    assert tied.flops_per_token(SEQ) == untied.flops_per_token(SEQ)


def test_bench_gpu_states_the_convention_its_mfu_uses():
    scripts = str(Path(__file__).resolve().parents[1] / "scripts" / "bench")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import bench_gpu

    said = bench_gpu.mfu_convention(torch.device("cpu"))
    assert "6 x (N - input embedding) + 12 x L x d x s" in said and "no MFU" in said  # no peak on a CPU
