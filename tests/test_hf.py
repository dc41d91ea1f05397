"""Hugging Face Llama interop (minipar/extras/hf.py, scripts/tools/convert.py, train.py --init-from).

Every test builds a small random LlamaForCausalLM locally (no download) and holds minipar to the
logits transformers itself computes, on one process and under tp2, pp2 and cp2.

transformers computes RoPE's angles and RMSNorm's mean square in float32 whatever the model's
dtype, so in float64 its logits are only float32-accurate. The float64 comparison therefore lifts
those two casts: the norms compute the same formula in float64, and the rotary embedding gets
float64 angles from minipar's frequencies, which a separate test holds to transformers' own
(Llama-3 scaling included) at float32 precision.
"""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import parallel_llama, run_ranks, tiers
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach for the Hub
transformers = pytest.importorskip("transformers")

from minipar.context_parallel import split_sequence, zigzag_positions  # noqa: E402
from minipar.extras.hf import HFError, import_hf  # noqa: E402
from minipar.mesh import Mesh  # noqa: E402
from minipar.model import rope_frequencies  # noqa: E402
from minipar.ops import run_folder  # noqa: E402
from minipar.run import checkpoint  # noqa: E402
from minipar.tensor_parallel import gather_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}  # head_dim 8: one frequency kept, one blended, two slowed
MODELS = {  # vocabulary 251: tp pads it; one kv head: tp2 gives each rank the whole of it
    "tied-gqa-llama3": dict(tie_word_embeddings=True, num_key_value_heads=2, rope_theta=500000.0,
                            rope_scaling=LLAMA3_ROPE),
    "untied-1kv": dict(tie_word_embeddings=False, num_key_value_heads=1, rope_theta=10000.0),
}
# float32: a logit's path runs through ~600 rounded additions (2 layers of 8- to 64-long sums, the norms
# and the head), each within eps 1.2e-7: 7e-5 of its size at worst; a logit near 0 errs by that share of
# the logits' scale (RMS ~2): atol 1.5e-4. Seen: 1.03e-5 at worst, on AVX2 and AVX-512. Float64: tight.
TOL = {torch.float32: dict(rtol=7e-5, atol=1.5e-4), torch.float64: dict(rtol=0, atol=1e-10)}


def convert():
    spec = importlib.util.spec_from_file_location("convert_script", ROOT / "scripts" / "tools" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_llama(folder: Path, seed: int = 0, shard_size=None, vocab: int = 251, eps: float = 1e-6, max_pos: int = 512,
             **kw) -> Path:
    """A random LlamaForCausalLM saved to `folder`, weights drawn at 0.3 so the logits are not tiny."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=max_pos, rms_norm_eps=eps, **kw)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor, dtype) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    if dtype == torch.float64:  # no float32 inside (see the module docstring)
        for norm in [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]:
            norm.forward = lambda x, n=norm: n.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                        + n.variance_epsilon)
        config, _ = import_hf(folder)
        freqs, rotary = rope_frequencies(config), model.model.rotary_emb
        assert rotary.attention_scaling == 1.0

        def float64_angles(x, position_ids):
            angles = position_ids[..., None].double() * freqs
            angles = torch.cat([angles, angles], dim=-1)
            return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rotary.forward = float64_angles
    with torch.no_grad():
        return model(tokens).logits


def tokens(vocab: int = 251) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    """(HF folder, minipar checkpoint converted from it, name); the tied one saved in shards."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf = hf_llama(tmp / "hf", shard_size="20KB" if "tied" in request.param else None, **MODELS[request.param])
    return hf, convert().main(["import", str(hf), str(tmp / "minipar")]), request.param


def test_sharded_and_tied_checkpoints_are_read(imported):
    hf, ckpt, name = imported
    assert (hf / "model.safetensors.index.json").exists() == ("tied" in name)
    weights = load_file(ckpt / "model.safetensors")
    assert ("lm_head.weight" in weights) == ("untied" in name)  # a tied model has one table


@pytest.mark.float32
def test_rope_frequencies_equal_transformers_own_llama3_scaled_ones(imported):
    hf, _, _ = imported
    model = transformers.LlamaForCausalLM.from_pretrained(hf)
    config, _ = import_hf(hf)
    ours = rope_frequencies(config)
    # transformers' float32 pow, division and Llama-3 blend, each within an ulp or two: 8 eps = 1e-6. The
    # frequencies are all positive (1 down to 7e-6) and compared relatively: atol 0.
    torch.testing.assert_close(ours.float(), model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    if config.rope_factor != 1:  # each regime of the scaling met: kept, blended, slowed by the factor
        plain = rope_frequencies(replace(config, rope_factor=1.0))
        assert ours[0] == plain[0] and plain[1] / 8 < ours[1] < plain[1] and ours[-1] == plain[-1] / 8


def _logits(rank, world, ckpt, degrees, dtype):
    """This layout's full logits on rank 0, the model built from the imported checkpoint."""
    import torch.distributed as dist

    from minipar.pipeline.executor import Pipeline

    with Mesh.build(**degrees) as mesh:
        path = run_folder.resolve(ckpt)
        config = checkpoint.model_config_of(path, checkpoint.verify(path))
        pipe = Pipeline(mesh.groups().pp, "1f1b", config.n_layers) if mesh.layout.pp > 1 else None
        model = parallel_llama(config, tp_group=mesh.groups().tp, cp_group=mesh.groups().cp,
                               layer_ids=pipe.my_layers() if pipe else None, embed=not pipe or pipe.holds_first(),
                               head=not pipe or pipe.holds_last()).to(dtype)
        checkpoint.load_weights(path, model, mesh.groups())  # each rank reads its shards only
        x = split_sequence(tokens(config.vocab_size), mesh.groups().cp)
        with torch.no_grad():
            if pipe is None:
                out = model(x)
            elif pipe.holds_first():
                dist.send(model.forward_stage(x, pipe.my_layers(), first=True, last=False), 1)
                return None
            else:
                h = torch.empty(*x.shape, config.dim, dtype=dtype)
                dist.recv(h, 0)
                out = model.forward_stage(h, pipe.my_layers(), first=False, last=True)
        out = gather_logits(out, mesh.groups().tp, config.vocab_size)
        return out, zigzag_positions(mesh.groups().cp.rank, mesh.groups().cp.size, 16)


LAYOUTS = {"one": (1, {}), "tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2)), "cp2": (2, dict(cp=2))}


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.float32), torch.float64],
                         ids=["float32", "float64"])
@pytest.mark.parametrize("layout", tiers(list(LAYOUTS), fast=1))  # make test: tp2
def test_imported_model_gives_transformers_logits_under_each_layout(imported, layout, dtype):
    hf, ckpt, name = imported
    if layout == "pp2" and "untied" not in name:
        pytest.skip("tied embeddings are refused under pp > 1 (test_tied_embeddings_refuse_a_pipeline_split)")
    world, degrees = LAYOUTS[layout]
    expected = hf_logits(hf, tokens(), dtype)
    full = torch.empty_like(expected)
    for r in run_ranks(world, _logits, ckpt, degrees, dtype):
        if r is not None:
            logits, positions = r
            full[:, positions] = logits  # cp: each rank's zigzag share of the sequence
    assert expected.abs().max() > 1  # a comparison of logits that say something
    torch.testing.assert_close(full, expected, **TOL[dtype])


def test_tied_embeddings_refuse_a_pipeline_split():
    from minipar.model import get_config
    from minipar.ops.command_line import parse_args
    from minipar.run.config import ConfigError

    # one rule (parallelize.check_parallelize), asked by parallelize and by the run's checks
    with pytest.raises(ValueError, match="tied embeddings with --pp above 1"):
        parallel_llama(get_config("tiny", tie_embeddings=True), layer_ids=[0], embed=True, head=False)
    with pytest.raises(ConfigError, match=r"tied embeddings with --pp above 1: .* \(--model tiny\)$"):
        parse_args(["--model", "tiny", "--vocab-size", "512", "--tie-embeddings", "--pp", "2", "--global-batch", "16"])


def test_export_then_import_round_trips_bitwise(imported, tmp_path):
    hf, ckpt, _ = imported
    convert().main(["export", str(ckpt), str(tmp_path / "hf")])
    again = convert().main(["import", str(tmp_path / "hf"), str(tmp_path / "again")])
    first, second = load_file(run_folder.resolve(ckpt) / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[n], second[n]) and first[n].dtype == second[n].dtype for n in first)
    assert import_hf(hf)[0] == import_hf(tmp_path / "hf")[0]  # the same config
    original = {}  # and the exported tensors are transformers' own, under transformers' names
    for file in hf.glob("*.safetensors"):
        original.update(load_file(file))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(exported[n], original[n]) for n in exported) and exported.keys() <= original.keys()
    # transformers reads the exported config.json as it read its own (RoPE scaling, tying): the same logits
    assert torch.equal(hf_logits(tmp_path / "hf", tokens(), torch.float32), hf_logits(hf, tokens(), torch.float32))


def test_bad_folders_are_refused_in_one_line(tmp_path, capsys):
    script = convert()
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "nope", "no such folder"), (tmp_path / "empty", "no config.json")]
    for model_type, rope, why in (("mistral", {}, "only Llama"), ("llama", {"rope_type": "yarn"}, "rope type"),
                                  ("llama", {"rope_type": "default"}, "lacks num_hidden_layers")):
        folder = tmp_path / model_type / (rope.get("rope_type") or "default")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, "rope_scaling": rope,
                                                        "hidden_size": 32, "num_attention_heads": 4}))
        cases.append((folder, why))
    for folder, why in cases:
        with pytest.raises(SystemExit) as e:
            script.main(["import", str(folder), str(tmp_path / "out")])
        assert e.value.code == 2 and why in str(e.value)
        assert capsys.readouterr().err.splitlines() == [str(e.value)] and str(e.value).startswith("minipar: error: ")
    with pytest.raises(HFError, match="only Llama"):
        import_hf(cases[2][0])


def test_init_from_refuses_weights_of_another_model(imported, tmp_path):
    from minipar.ops.command_line import parse_args
    from minipar.ops.preflight import check_init_from
    from minipar.run.config import ConfigError

    _, ckpt, name = imported
    path = run_folder.resolve(ckpt)
    tie = ["--tie-embeddings"] if "untied" not in name else []
    with pytest.raises(ConfigError, match="--init-from and --resume"):
        parse_args(["--init-from", str(ckpt), "--resume", str(ckpt)])
    for flags, what in ((["--model", "small"], "dim 32"),
                        (["--model", "tiny", "--vocab-size", "300"], "its model has")):
        with pytest.raises(ConfigError, match=what):
            check_init_from(parse_args(flags + tie + ["--init-from", str(ckpt)]), path)


SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "tie_embeddings")


def test_init_from_alone_takes_the_model_from_the_weights_and_a_flag_given_must_agree(imported, tmp_path):
    """As from_pretrained: no --model and no shape flag; the effective config holds the weights' shape."""
    from minipar.ops.command_line import parse_args
    from minipar.ops.preflight import check_init_from
    from minipar.run.config import ConfigError, effective

    _, ckpt, _ = imported
    path = run_folder.resolve(ckpt)
    saved = checkpoint.model_config_of(path, checkpoint.verify(path))
    tok = ["--tokenizer", str(tmp_path / "tokenizer.json")]  # a Hugging Face model comes with its own
    cfg = parse_args(["--init-from", str(ckpt.parent), *tok])  # the --out folder: its newest checkpoint
    check_init_from(cfg, path)
    assert {n: getattr(cfg.model_config(), n) for n in SHAPE} == {n: getattr(saved, n) for n in SHAPE}
    assert f"n-layers = {saved.n_layers}" in effective(cfg) and f"dim = {saved.dim}" in effective(cfg)
    with pytest.raises(ConfigError, match=f"its model has n_layers {saved.n_layers}, .* pass --n-layers "
                                          f"{saved.n_layers}"):
        check_init_from(parse_args(["--init-from", str(ckpt), "--n-layers", str(saved.n_layers + 1), *tok]), path)
    tie = "--tie-embeddings" if not saved.tie_embeddings else "--no-tie-embeddings"
    with pytest.raises(ConfigError, match="its model has tie_embeddings"):
        check_init_from(parse_args(["--init-from", str(ckpt), tie, *tok]), path)


def test_train_py_refuses_init_from_another_model_in_one_line_before_any_process_group(imported, tmp_path, capsys):
    import torch.distributed as dist

    import minipar.ops.cli

    _, ckpt, _ = imported
    corpus = Path(__import__("sysconfig").get_paths()["stdlib"]) / "argparse.py"
    common = ["--data", str(corpus), "--out", str(tmp_path / "out"), "--no-wandb", "--model", "tiny",
              "--vocab-size", "300"]
    for source, why in ((ckpt, "its model has"), (tmp_path / "nope", "--init-from {}: no such folder")):
        assert minipar.ops.cli.main(common + ["--init-from", str(source)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and why.format(source) in err[0], err
    assert not dist.is_initialized()


@pytest.mark.integration
def test_import_train_20_steps_at_dp2_tp2_export_and_generate_with_transformers(tmp_path):
    """The tiny preset's shape, tied, with a RoPE base and norm epsilon of its own (no flag sets them:
    the run takes them from the weights); 20 steps at dp2 x tp2 from the imported weights; back to
    transformers, which loads the result and generates."""
    hf = hf_llama(tmp_path / "hf", vocab=512, eps=1e-6, max_pos=128, tie_word_embeddings=True, num_key_value_heads=2,
                  rope_theta=5000.0)
    convert().main(["import", str(hf), str(tmp_path / "imported")])
    corpus = Path(__import__("sysconfig").get_paths()["stdlib"]) / "argparse.py"
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             str(ROOT / "scripts" / "train.py"), f"--data={corpus}",  # the model: --init-from's alone
             f"--cache-dir={tmp_path / 'cache'}", "--seq-len=32", "--global-batch=8",
             "--micro-batch=4", "--dp=2", "--tp=2", "--steps=20", "--warmup=2", f"--init-from={tmp_path / 'imported'}",
             f"--out={tmp_path / 'run'}", "--no-wandb", "--log-every=1", f"--log-json={tmp_path / 'log.json'}"]
    run = subprocess.run(train, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "started from the weights of" in run.stdout + run.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log.json").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0]
    built = json.loads((tmp_path / "run" / "step_000020" / "train_state.json").read_text())["model_config"]
    assert (built["rope_theta"], built["norm_eps"]) == (5000.0, 1e-6)  # the weights', not tiny's 10000 and 1e-5
    convert().main(["export", str(tmp_path / "run"), str(tmp_path / "exported")])
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    trained = load_file(tmp_path / "run" / "step_000020" / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, trained["tok_emb.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11) and torch.equal(out[:, :3], prompt)
    from minipar.extras.generate import generate, plain_model_from  # what sample.py and eval.py load

    ours, _ = plain_model_from(tmp_path / "run" / "step_000020")
    assert ours.lm_head.weight is ours.tok_emb.weight
    assert torch.equal(generate(ours, prompt, 8), out)  # the same greedy continuation
