"""The reference model: deterministic, layout-independent init; forward/backward; the config maths."""

import pytest
import torch
import torch.nn.functional as F

from minipar.model import (
    CONFIGS,
    Llama,
    ModelConfig,
    apply_rope,
    get_config,
    init_tensor,
    rope_cos_sin,
    rope_frequencies,
)


def tiny(**kw):
    return get_config("tiny", **kw)


def test_two_constructions_with_one_seed_are_identical_and_seeds_differ():
    a, b, c = Llama(tiny(), seed=3), Llama(tiny(), seed=3), Llama(tiny(), seed=4)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n


def test_init_depends_only_on_seed_and_name_not_on_construction_order():
    # Each parameter is drawn from its own generator: a slice of it (what a tp shard will hold)
    # is fixed by (seed, name) alone, and no two parameters share values by accident.
    m = Llama(tiny(), seed=7)
    w = dict(m.named_parameters())["layers.1.attn.wq.weight"]
    full = init_tensor("layers.1.attn.wq.weight", tuple(w.shape), 0.02, seed=7)
    assert torch.equal(w.detach(), full)
    assert not torch.equal(w, dict(m.named_parameters())["layers.0.attn.wq.weight"])


def test_forward_backward_runs_and_loss_is_cross_entropy_of_logits():
    torch.manual_seed(0)
    m = Llama(tiny(), seed=0).double()
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    y[0, :3] = -100
    logits = m(x)
    assert logits.shape == (2, 16, 256)
    loss = m(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # ~uniform at init


def test_attention_is_causal():
    m = Llama(tiny(), seed=0).double()
    x = torch.randint(0, 256, (1, 12))
    x2 = x.clone()
    x2[0, 8:] = (x2[0, 8:] + 1) % 256  # change only the future of position 7
    torch.testing.assert_close(m(x)[0, :8], m(x2)[0, :8], rtol=0, atol=0)


def test_rope_rotates_by_relative_position():
    # <R(p) q, R(p') k> depends only on p - p': shifting every position leaves scores unchanged.
    q, k = torch.randn(1, 1, 5, 8, dtype=torch.float64), torch.randn(1, 1, 5, 8, dtype=torch.float64)
    def scores(offset):
        freqs = rope_frequencies(ModelConfig(dim=32, n_heads=4))  # head_dim 8
        cos, sin = rope_cos_sin(torch.arange(5) + offset, freqs, torch.float64)
        return apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)
    torch.testing.assert_close(scores(0), scores(37), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["tiny", "small", pytest.param("125m", marks=pytest.mark.integration), "tiny-tied"])
def test_num_params_formula_equals_the_built_model(name):
    cfg = get_config("tiny", tie_embeddings=True) if name == "tiny-tied" else CONFIGS[name]
    assert cfg.num_params() == sum(p.numel() for p in Llama(cfg, seed=0).parameters())


def test_named_configs_have_real_shapes():
    # The parameter counts Meta publishes for the models the presets are named after.
    assert CONFIGS["1b"].num_params() == 1_235_814_400  # Llama-3.2-1B (tied embeddings)
    assert CONFIGS["8b"].num_params() == 8_030_261_248  # Llama-3.1-8B
    assert CONFIGS["70b"].num_params() == 70_553_706_496  # Llama-3.1-70B
    assert CONFIGS["405b"].num_params() == 405_853_388_800  # Llama-3.1-405B
    with pytest.raises(ValueError, match="unknown model"):
        get_config("nope")


def test_the_plain_model_imports_nothing_parallel():
    # model.py is the single-device reference: parallelize.py applies every parallel idea to it.
    import ast
    from pathlib import Path

    import minipar.model
    import minipar.moe

    # The plain Llama imports nothing of minipar (chapter 7 adds its experts' block from outside);
    # the mixture-of-experts block imports only the model it plugs into.
    for module, allowed in ((minipar.model, set()), (minipar.moe, {"minipar.model"})):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert {m for m in imported if m.startswith("minipar")} == allowed, imported
        assert "torch.distributed" not in imported


def test_parallelize_with_every_degree_one_returns_the_plain_model():
    from minipar.collectives import Group
    from minipar.parallelize import parallelize

    plain = Llama(tiny(), seed=2).double()
    same = parallelize(Llama(tiny(), seed=2).double(), tp=Group.solo("tp"), cp=Group.solo("cp"))
    assert [type(m) for m in same.modules()] == [type(m) for m in plain.modules()]
    assert same.state_dict().keys() == plain.state_dict().keys()
    for name, t in plain.state_dict().items():
        assert torch.equal(same.state_dict()[name], t), name
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(same(x, torch.roll(x, -1, 1)), plain(x, torch.roll(x, -1, 1)), rtol=0, atol=0)
