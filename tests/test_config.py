"""The configuration: a TOML file (`--config`) gives the config of the equivalent flags and the same
run bitwise, the command line overrides it; the shape flags override the preset, whose vocabulary
the model keeps (the BPE fits inside it); the effective config is printed and saved with each
checkpoint; `--help` states each default once; `--profile-steps` takes steps of the run, A:B; a
setting declared once has its flag, help, file key, refusal and place in the planner's flags."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace

import pytest
from safetensors.torch import load_file
from test_train import CORPUS, losses, run

from minipar.layout import setting
from minipar.model import get_config
from minipar.ops import command_line
from minipar.ops.command_line import config_file_text, parse_args, parser
from minipar.planning.planner import Choice
from minipar.run.config import ConfigError, TrainConfig, as_toml, effective

# The same settings twice: as flags, and as a TOML file written by hand (dashes and underscores,
# an integer for a float, switches as true/false).
FLAGS = [f"--data={CORPUS}", "--model=tiny", "--dim=48", "--n-layers=3", "--n-heads=6", "--ffn-dim=96",
         "--vocab-size=600", "--bpe-vocab=512", "--seq-len=32", "--global-batch=8", "--micro-batch=4", "--lr=1",
         "--min-lr-ratio=0.5", "--warmup=2", "--dtype=float64", "--recompute", "--no-wandb"]
TOML = f"""# the settings of FLAGS
data = "{CORPUS}"
model = "tiny"
dim = 48
n-layers = 3
n_heads = 6
ffn-dim = 96
vocab_size = 600
bpe-vocab = 512
seq-len = 32
global_batch = 8
micro-batch = 4
lr = 1
min-lr-ratio = 0.5
warmup = 2
dtype = "float64"
recompute = true
wandb = false
"""


def test_a_toml_file_gives_the_config_of_the_equivalent_flags(tmp_path):
    (tmp_path / "run.toml").write_text(TOML)
    flags = parse_args(FLAGS)
    from_file = parse_args([f"--config={tmp_path / 'run.toml'}"])
    assert asdict(from_file) == asdict(replace(flags, config=str(tmp_path / "run.toml")))
    assert flags.lr == 1.0 and isinstance(from_file.lr, float) and from_file.recompute and not from_file.wandb


def test_flags_on_the_command_line_override_the_file(tmp_path):
    (tmp_path / "run.toml").write_text(TOML + "steps = 7\n")
    cfg = parse_args([f"--config={tmp_path / 'run.toml'}", "--no-recompute", "--steps=9", "--dim=24", "--wandb"])
    assert (cfg.recompute, cfg.steps, cfg.dim, cfg.wandb) == (False, 9, 24, True)
    assert (cfg.n_layers, cfg.vocab_size, cfg.lr) == (3, 600, 1.0)  # the file's, where no flag was given


def test_the_effective_config_read_back_as_a_file_is_the_same_config(tmp_path):
    cfg = parse_args(FLAGS)
    (tmp_path / "effective.toml").write_text(as_toml(asdict(cfg)))
    again = parse_args([f"--config={tmp_path / 'effective.toml'}"])
    assert asdict(again) == asdict(replace(cfg, config=str(tmp_path / "effective.toml")))
    line = effective(cfg)
    assert line.startswith("effective config: dp = 1, tp = 1,") and "dim = 48, n-layers = 3, n-heads = 6" in line


def test_shape_flags_override_the_preset_and_every_field_is_written_in():
    cfg = parse_args(["--model=small", "--dim=64", "--n-layers=2", "--n-kv-heads=4"])
    assert cfg.model_config() == replace(get_config("small"), dim=64, n_layers=2, n_kv_heads=4)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size, cfg.max_seq_len) == (
        64, 2, 4, 4, 384, 4096, 1024)  # the rest: small's


@pytest.mark.parametrize("typed", ["qwz,qwz", "qwz,", " qwz", "qwz, qwz"])
def test_zeropp_is_stored_as_read_not_as_typed(typed):
    cfg = parse_args(["--dp=2", "--micro-batch=8", "--zero=3", f"--zeropp={typed}", "--plan"])
    assert cfg.zeropp == "qwz"  # the effective config and the checkpoint keep the names, each once


def test_the_precision_flags_offer_what_precision_py_declares_and_it_refuses_the_rest():
    from minipar.precision import DTYPES, GRAD_REDUCE, PRECISIONS, resolve

    choices = {a.dest: a.choices for a in parser()._actions}
    assert (choices["precision"], choices["dtype"], choices["grad_reduce"]) == (PRECISIONS, DTYPES, GRAD_REDUCE)
    for args, line in [((None, "float16"), "--dtype float16: choose float32, float64, bfloat16"),
                       (("bf16-mixed", None, "fp8"), "--grad-reduce fp8: choose bf16 or fp32"),
                       (("fp32", "float64"), "--dtype float64 with --precision fp32: float64 runs everything")]:
        with pytest.raises(ValueError, match=line):
            resolve(*args)


def test_a_preset_keeps_its_own_vocabulary_and_the_bpe_fits_inside_it():
    big = parse_args(["--model=8b"])
    assert big.model_config() == get_config("8b") and big.vocab_size == 128256  # not the BPE's 4096
    assert big.bpe_vocab == 4096  # the BPE trained on --data: at most 4096 by default
    small = parse_args(["--model=small"])
    assert (small.vocab_size, small.bpe_vocab) == (4096, 4096)  # the default run: unchanged
    assert parse_args(["--model=small", "--vocab-size=300"]).bpe_vocab == 300  # never more than the model's


def test_a_toml_run_equals_the_flags_run_bitwise_and_its_checkpoint_keeps_the_effective_config(tmp_path):
    cache = f"--cache-dir={tmp_path / 'cache'}"
    flags = run(FLAGS + [cache, "--steps=6", f"--out={tmp_path / 'a'}", f"--log-json={tmp_path / 'a.jsonl'}"])
    (tmp_path / "run.toml").write_text(TOML + "steps = 6\n")
    from_file = run([f"--config={tmp_path / 'run.toml'}", cache, f"--out={tmp_path / 'b'}",
                     f"--log-json={tmp_path / 'b.jsonl'}"])
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert sorted(a) == list(range(1, 7)) and a == b  # bitwise
    saved = json.loads((tmp_path / "b" / "step_000006" / "train_state.json").read_text())["config"]
    same = [cache, "--steps=6", f"--out={tmp_path / 'b'}", f"--log-json={tmp_path / 'b.jsonl'}",
            f"--config={tmp_path / 'run.toml'}"]
    assert saved == asdict(parse_args(FLAGS + same))
    printed = [line for line in from_file.stdout.splitlines() if line.startswith("effective config: ")]
    assert len(printed) == 1 and "vocab-size = 600, max-seq-len = 128" in printed[0]
    assert "effective config: " in flags.stdout
    # The model the shape flags asked for: 3 blocks of width 48, 600 embedding rows; the BPE has 512 tokens.
    weights = load_file(tmp_path / "b" / "step_000006" / "model.safetensors")
    assert weights["tok_emb.weight"].shape == (600, 48) and "layers.2.mlp.w_up.weight" in weights
    assert weights["layers.0.mlp.w_up.weight"].shape == (96, 48)
    assert "vocab 600 (the tokenizer's 512)" in from_file.stdout


def help_entries() -> dict[str, str]:
    """--help's text for each flag: {"--steps STEPS": "optimizer steps (default: 300)", ...}."""
    entries, current = {}, None
    for line in parser().format_help().splitlines():
        if line.startswith("  -"):
            current = line.split("  ")[1].strip()
            entries[current] = " ".join(line.split("  ")[2:]).strip()
        elif current and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_help_states_each_default_once_and_never_none():
    entries = help_entries()
    assert len(entries) > 40 and "--dim DIM" in entries and "--wandb, --no-wandb" in entries
    for flag, text in entries.items():
        assert text, f"{flag} has no help"
        assert text.count("default") <= 1, (flag, text)
        assert "(default: None)" not in text, (flag, text)
    assert entries["--steps STEPS"] == "optimizer steps (default: 300)"
    assert entries["--dim DIM"] == "hidden size (default: the preset's)"
    assert "(default: the Python standard library)" in entries["--data DATA"]


@pytest.mark.parametrize("argv", [["--bpe-vocab=8192"], ["--model=tiny"]])
def test_a_tokenizer_that_does_not_fit_the_model_is_refused(argv):
    from minipar.run.config import ConfigError

    with pytest.raises(ConfigError, match="cannot hold a byte-level BPE|does not fit in the model's vocabulary"):
        parse_args(argv)


def test_a_checkpoint_from_before_the_shape_flags_resumes_with_its_model_and_bpe_written_in(tmp_path):
    """Checkpoints saved before the shape flags, --bpe-vocab and --val-fraction kept only --model and
    the BPE's size (as vocab_size): the model they saved fills the shape in, vocab_size the BPE's
    size, the defaults the rest; such a checkpoint resumes, and another shape is still refused."""
    from minipar.ops.preflight import check_resume, saved_settings
    from minipar.run.config import ConfigError

    old = {"model": "tiny", "vocab_size": 512, "data": CORPUS, "seq_len": 32, "global_batch": 8, "seed": 0,
           "lr": 1.0, "min_lr_ratio": 0.5, "warmup": 2}
    state = {"step": 4, "consumed": 32, "config": old, "model_config": asdict(get_config("tiny", vocab_size=512))}
    before = saved_settings(tmp_path, state)
    assert (before["dim"], before["vocab_size"], before["bpe_vocab"], before["tie_embeddings"],
            before["val_fraction"]) == (32, 512, 512, False, 0.0)
    argv = [a for a in FLAGS if not a.startswith(("--dim", "--n-", "--ffn", "--vocab", "--bpe", "--recompute"))]
    check_resume(parse_args(argv + ["--vocab-size=512", "--steps=10"]), state, tmp_path)  # continues it
    with pytest.raises(ConfigError, match="--dim 48 differs from the checkpoint's 32"):
        check_resume(parse_args(argv + ["--vocab-size=512", "--dim=48", "--n-heads=6", "--steps=10"]), state,
                     tmp_path)


def test_profile_steps_is_in_the_effective_config_and_a_file_gives_it_back(tmp_path):
    cfg = parse_args(["--steps=3", "--profile-steps=2:3"])
    assert cfg.profiled() == (2, 3) and 'profile-steps = "2:3"' in effective(cfg)
    (tmp_path / "run.toml").write_text(as_toml(asdict(cfg)))
    assert parse_args([f"--config={tmp_path / 'run.toml'}"]).profiled() == (2, 3)


@pytest.mark.parametrize("flag, words", [
    ("5", "give the first and last step to profile as A:B"), ("3:2", "give steps A <= B from 1 to --steps 3"),
    ("2:4", "a step outside the run would profile nothing"), ("0:1", "from 1 to --steps 3"), ("", "as A:B")])
def test_profile_steps_the_run_does_not_take_are_refused(flag, words):
    from minipar.run.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_args(["--steps=3", f"--profile-steps={flag}"])


def test_print_config_prints_a_file_that_gives_the_same_run_without_its_folders(tmp_path, monkeypatch, capsys):
    from minipar.ops import cli
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # --print-config, like --plan, launches nothing
    argv = [*FLAGS, "--dp=2", f"--out={tmp_path / 'run'}", f"--log-json={tmp_path / 'log.jsonl'}"]
    assert cli.main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "dp = 2\n" in text and "\nout =" not in text and "log-json" not in text and "print-config" not in text
    (tmp_path / "run.toml").write_text(text)
    monkeypatch.setenv("WORLD_SIZE", "2")
    again = parse_args([f"--config={tmp_path / 'run.toml'}"])
    assert asdict(again) == asdict(replace(parse_args(argv), config=str(tmp_path / "run.toml"), out=None,
                                           log_json=None))
    assert not (tmp_path / "run").exists()


@dataclass
class WithFusedAdam(TrainConfig):  # a new setting: this declaration is all it takes
    fused_adam: bool = setting(False, "one kernel steps every parameter's Adam", "optimisation",
                               acts_with=("--tp 2 or more", lambda c: c.tp > 1), plan="memory")


def test_a_setting_declared_once_has_its_flag_help_file_key_refusal_and_planned_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(command_line, "TrainConfig", WithFusedAdam)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    help_ = help_entries()["--fused-adam, --no-fused-adam"].strip()
    assert help_ == "one kernel steps every parameter's Adam (default: False)"
    assert parse_args(["--tp=2", "--fused-adam", "--plan"]).fused_adam
    (tmp_path / "run.toml").write_text("tp = 2\nfused-adam = true\nplan = true\n")
    cfg = parse_args([f"--config={tmp_path / 'run.toml'}"])
    assert cfg.fused_adam and "\nfused-adam = true\n" in config_file_text(cfg)
    with pytest.raises(ConfigError, match="^--fused-adam acts only with --tp 2 or more, which this run has not"):
        parse_args(["--fused-adam", "--plan"])
    assert parse_args(["--no-fused-adam", "--plan"]).fused_adam is False  # named at its default: asks nothing
    assert Choice(cfg, None, 0).flags() == "--tp 2 --fused-adam"
