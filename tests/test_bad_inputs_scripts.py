"""The scripts around training refuse bad input like train.py: convert.py, sample.py, eval.py,
plan.py and trace_report.py each end a bad flag or file with exactly one `minipar: error:` line on
stderr, exit code 2 and no traceback, naming the flag or file; no path they read leaves the folder
they were given.

Each case runs the script's main() in this process (a subprocess costs seconds of torch import);
one case per script also runs as `python scripts/X.py`, so the exit code and the stream are the
program's own. The argparse types of minipar/ops/args.py, which every script shares, are held to
their ranges here too."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest
from safetensors import safe_open

from minipar.extras.hf import export_hf
from minipar.mesh import Groups
from minipar.model import Llama, get_config
from minipar.ops import args as checks
from minipar.ops.command_line import parse_args
from minipar.run import checkpoint
from minipar.run.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"  # ~20 KB of held-out text
VOCAB = 288  # the tiny model's embedding rows: the BPE below (256 bytes, <|endoftext|>, a few merges) fits


def script_path(name: str) -> Path:
    """scripts/tools/NAME.py, or scripts/NAME.py for the run's launchers (train.py, train_ft.py)."""
    return ROOT / "scripts" / (f"{name}.py" if name.startswith("train") else f"tools/{name}.py")


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", script_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPTS = {name: script(name) for name in ("convert", "sample", "eval", "plan", "trace_report", "train_ft")}


def tokenizer_json(path: Path, text: str | None = None) -> None:
    """A byte-level BPE of about 270 tokens, trained here on a few lines of code (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=270, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text or TEXT.read_text()[:4000]], trainer)
    tok.save(str(path))


def hf_variant(t: Path, name: str, edit=None, config_bytes: bytes | None = None) -> None:
    """A copy of the exported Hugging Face folder t/hf with its config.json edited or replaced."""
    (t / name).mkdir()
    (t / name / "model.safetensors").symlink_to(t / "hf" / "model.safetensors")
    config = json.loads((t / "hf" / "config.json").read_text())
    (t / name / "config.json").write_bytes(config_bytes if config_bytes is not None else
                                           json.dumps(edit(config) if edit else config).encode())


@pytest.fixture(scope="module")
def t(tmp_path_factory):
    return inputs(tmp_path_factory.mktemp("scripts"))


def inputs(t: Path) -> Path:
    """A tiny checkpoint with its tokenizer, one without whose train_state.json climbs out of its
    cache, Hugging Face folders good and bad, and files that block, loop or link to themselves."""
    tokenizer_json(t / "tok.json")
    tokenizer_json(t / "tok_other.json", TEXT.read_text()[4000:8000])  # the same kind and size, other merges
    model = get_config("tiny", vocab_size=VOCAB)
    weights, optimizer, hyper = checkpoint.gather_full(Llama(model), {}, [], Groups())
    run = asdict(TrainConfig(model="tiny", vocab_size=VOCAB, seq_len=32, cache_dir=str(t / "cache")))
    state = {"step": 2, "consumed": 2 * run["global_batch"], "config": run, "model_config": asdict(model)}
    checkpoint.save(t / "run", 2, weights, optimizer, hyper, state, tokenizer=t / "tok.json")
    for name, key in (("climbs", "../../outside"), ("absolute", "/etc")):  # no tokenizer.json: the cache's is read
        checkpoint.save(t / name, 2, weights, optimizer, hyper, {**state, "data_key": key})
    export_hf(model, weights, t / "hf")
    (t / "hf_truncated").mkdir()
    (t / "hf_truncated" / "config.json").write_bytes((t / "hf" / "config.json").read_bytes())
    (t / "hf_truncated" / "model.safetensors").write_bytes((t / "hf" / "model.safetensors").read_bytes()[:5000])
    hf_variant(t, "hf_zero", lambda c: {**c, "hidden_size": 0})
    hf_variant(t, "hf_negative", lambda c: {**c, "num_hidden_layers": -2})
    hf_variant(t, "hf_null", lambda c: {**c, "intermediate_size": None})
    hf_variant(t, "hf_list", config_bytes=b"[1, 2, 3]")
    hf_variant(t, "hf_tied_other", lambda c: {**c, "tie_word_embeddings": True})  # its lm_head is no embedding
    hf_variant(t, "hf_random", config_bytes=bytes(range(255, 0, -3)) * 4)
    hf_variant(t, "hf_escape")
    (t / "hf_escape" / "model.safetensors").unlink()
    (t / "outside.safetensors").symlink_to(t / "hf" / "model.safetensors")
    with safe_open(t / "hf" / "model.safetensors", "pt") as f:  # every tensor in a shard outside the folder
        index = {"weight_map": {name: "../outside.safetensors" for name in f.keys()}}
    (t / "hf_escape" / "model.safetensors.index.json").write_text(json.dumps(index))
    (t / "bad_tok.json").write_bytes((t / "tok.json").read_bytes()[:300])  # cut off mid-JSON
    os.mkfifo(t / "fifo")
    (t / "loop").symlink_to(t / "loop")  # resolves to itself
    (t / "me").mkdir()
    (t / "me" / "a.txt").write_bytes(TEXT.read_bytes())
    (t / "me" / "me").symlink_to(t / "me")  # a folder holding a link to itself: me/me/me/...
    (t / "latin1.toml").write_bytes('steps = 3\nmodel = "tiny" # Größe\n'.encode("latin-1"))
    (t / "a_folder").mkdir()
    (t / "broken").symlink_to(t / "nowhere")
    step = '{"ph": "X", "name": "ProfilerStep#1", "tid": 1, '
    for name, text in (("cut_trace", '{"traceEvents": [{"ph": "X"'), ("unstepped_trace", '{"traceEvents": []}'),
                       ("deep_trace", "[" * 100_000 + "]" * 100_000),  # json.loads: a RecursionError
                       ("nan_trace", '{"traceEvents": [' + step + '"ts": NaN, "dur": 5}]}'),
                       ("inf_trace", '{"traceEvents": [' + step + '"ts": 1, "dur": 1e999}]}')):
        (t / name).mkdir()
        (t / name / "rank0.pt.trace.json").write_text(text)
    (t / "huge_trace").mkdir()
    with open(t / "huge_trace" / "rank0.pt.trace.json", "wb") as f:
        f.truncate(2**31 + 1)  # sparse: it takes no disk
    return t


CASES = [  # (script, argv, a fragment of the one line)
    ("convert", ["import", "{t}/hf_truncated", "{t}/out"], "hf_truncated/model.safetensors is not a whole safetensors"),
    ("convert", ["import", "{t}/hf_zero", "{t}/out"], "hf_zero/config.json: hidden_size 0: a size is a whole number"),
    ("convert", ["import", "{t}/hf_negative", "{t}/out"], "hf_negative/config.json: num_hidden_layers -2"),
    ("convert", ["import", "{t}/hf_null", "{t}/out"], "hf_null/config.json: intermediate_size None"),
    ("convert", ["import", "{t}/hf_list", "{t}/out"], "hf_list/config.json holds a JSON list, not an object"),
    ("convert", ["import", "{t}/hf_random", "{t}/out"], "hf_random/config.json is not JSON"),
    ("convert", ["import", "{t}/hf_tied_other", "{t}/out"], "says tie_word_embeddings, but lm_head.weight in the"),
    ("convert", ["import", "{t}/hf_escape", "{t}/out"], "'../outside.safetensors' leads outside"),
    ("convert", ["import", "{t}/loop", "{t}/out"], "loop is a symlink loop"),
    ("convert", ["export", "{t}/loop", "{t}/out"], "export {t}/loop is a symlink loop"),
    ("convert", ["sideways", "{t}/hf", "{t}/out"], "argument direction: invalid choice: 'sideways'"),
    ("plan", ["--gpu-memory", "80"], "argument --gpu-memory: 80 has no unit: give e.g. 80GB or 80GiB"),
    ("plan", ["--gpu-memory", "lotsGB"], "argument --gpu-memory: 'lotsGB' is not a size"),
    ("plan", ["--gpus", "0"], "argument --gpus: 0 is out of range: give 1 or more"),
    ("plan", ["--gpu-memory", "-80GB"], "argument --gpu-memory: -80GB is out of range"),  # a value, not a flag
    ("plan", ["--mfu", "0"], "argument --mfu: 0 is out of range: give a fraction above 0"),
    ("plan", ["--headroom", "1"], "argument --headroom: 1 is out of range: give a share of the memory, 0 or more"),
    ("plan", ["--headroom", "-0.1"], "argument --headroom: -0.1 is out of range: give 0 or more"),
    ("plan", ["--global-batch", "0"], "argument --global-batch: 0 is out of range"),
    ("plan", ["--gpus-per-node", "0"], "argument --gpus-per-node: 0 is out of range"),
    ("plan", ["--seq-len", "-1"], "argument --seq-len: -1 is out of range"),
    ("plan", ["--model", "tiny", "--seq-len", "8192"], "--seq-len 8192 is above --model tiny's max_seq_len 128"),
    # flags that would change nothing: --calibrate's without it, the plan's with it (it measures the small model)
    ("plan", ["--calibrate-steps", "20"], "--calibrate-steps acts only with --calibrate, which this command has not"),
    ("plan", ["--calibrate-layouts", "--dp 2"], "--calibrate-layouts acts only with --calibrate"),
    ("plan", ["--calibrate", "--model", "70b"], "--model with --calibrate, which measures the small model on this "
     "machine and plans nothing: it would change nothing"),
    ("plan", ["--calibrate", "--gpus", "64"], "--gpus with --calibrate"),
    ("plan", ["--calibrate", "--headroom", "0.2"], "--headroom with --calibrate"),
    ("plan", ["--calibrate", "--calibrate-steps", "100000"], "--calibrate-steps 100000: give more than 5 (the first "
     "5 steps of each run are not measured), at most 1000"),
    ("plan", ["--calibrate", "--calibrate-layouts", "--dp 2 --dp 4"], "'--dp 2 --dp 4' is not a layout: give "
     "degrees, each once"),
    ("plan", ["--calibrate", "--calibrate-layouts", "--dp \u00b2"], "is not a layout"),  # a digit int() cannot read
    ("plan", ["--calibrate", "--calibrate-layouts", "--dp 2 --tp 2;--tp 2 --dp 2"], "names a layout twice"),
    ("plan", ["--calibrate", "--calibrate-layouts", ";"], "';' names a layout twice: give each once"),
    ("sample", ["{t}/run", "--temperature", "nan"], "argument --temperature: nan is not a finite number"),
    ("sample", ["{t}/run", "--temperature", "-1"], "argument --temperature: -1 is out of range: give 0 or more"),
    ("sample", ["{t}/run", "--temperature", "inf"], "argument --temperature: inf is not a finite number"),
    ("sample", ["{t}/run", "--temperature", "1e-40"], "--temperature 1e-40: give 0 (the most likely token) or 0.001"),
    ("sample", ["{t}/run", "--temperature", "1e9"], "--temperature 1e+09: give 0 (the most likely token) or 0.001 to"),
    ("sample", ["{t}/run", "--seed", str(2**64)], "--seed 18446744073709551616: give 0 to 2**64 - 1"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--batch-size", str(10**20)], "--batch-size 100000000000000000000: "
     "give 1 to 16777216 windows"),
    ("sample", ["{t}/run", "--tokenizer", "{t}/bad_tok.json"], "bad_tok.json: cannot load it as a Hugging Face"),
    ("sample", ["{t}/run", "--tokenizer", "{t}/fifo"], "fifo is not a regular file (a FIFO"),
    ("sample", ["{t}/run", "--tokenizer", "{t}/loop"], "argument --tokenizer: {t}/loop is a symlink loop"),
    ("sample", ["{t}/run", "--tokenizer", "{t}/a_folder"], "a_folder is a folder: give a file"),
    ("sample", ["{t}/run", "--tokenizer", "{t}/tok_other.json"], "tok_other.json is not the tokenizer of {t}/run"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--tokenizer", "{t}/tok_other.json"], "is not the tokenizer of"),
    ("sample", ["{t}/run", "--batch-size", "0"], "unrecognized arguments: --batch-size 0"),
    ("sample", ["{t}/run", "--tokens", "-5"], "argument --tokens: -5 is out of range: give 0 or more"),
    ("sample", ["{t}/run", "--top-k", "-3"], "argument --top-k: -3 is out of range: give 0 or more"),
    ("sample", ["{t}/run", "--tokens", "500"], "pass the model's max_seq_len 128: give --tokens"),
    ("sample", ["{t}/climbs"], "train_state.json's data_key: '../../outside' leads outside {t}/cache"),
    ("sample", ["{t}/absolute"], "train_state.json's data_key: '/etc' leads outside {t}/cache"),
    ("sample", ["{t}/loop"], "checkpoint {t}/loop is a symlink loop"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--max-windows", "-1"], "argument --max-windows: -1 is out of range"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--seq-len", "129"], "--seq-len 129 is above the model's max_seq_len"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--seq-len", "-4"], "argument --seq-len: -4 is out of range"),
    ("eval", ["{t}/run", "--data", str(TEXT), "--batch-size", "0"], "argument --batch-size: 0 is out of range"),
    ("eval", ["{t}/run", "--data", "{t}/me"], "--data: {t}/me/me links back to {t}/me, a folder it is in"),
    ("eval", ["{t}/run", "--data", "{t}/loop"], "--data {t}/loop is a symlink loop"),
    ("eval", ["{t}/run", "--data", "{t}/fifo"], "--data {t}/fifo is not a regular file"),
    ("eval", ["{t}/run", "--data", "{t}/broken"], "--data {t}/broken: a broken link"),
    ("eval", ["{t}/climbs", "--data", str(TEXT)], "leads outside {t}/cache"),
    ("train_ft", ["--groups", "1"], "--groups 1: give 2 or more (group 1 is the one killed)"),
    ("train_ft", ["--kill-at", "9,3"], "argument --kill-at: '9,3': give steps in increasing order"),
    ("train_ft", ["--kill-at", "0"], "argument --kill-at: 0 is out of range: give 1 or more"),
    ("train_ft", ["--steps", "10", "--kill-at", "10"], "--kill-at 10: give steps before --steps 10"),
    ("trace_report", ["{t}/missing"], "argument folder: {t}/missing: no such file or directory"),
    ("trace_report", ["{t}/a_folder"], "{t}/a_folder holds no rank*.pt.trace.json: give a folder train.py"),
    ("trace_report", ["{t}/cut_trace"], "cut_trace/rank0.pt.trace.json is not a Chrome trace of torch.profiler"),
    ("trace_report", ["{t}/unstepped_trace"], "has no ProfilerStep# ranges: it is not a trace of train.py"),
    ("trace_report", ["{t}/deep_trace"], "deep_trace/rank0.pt.trace.json is not a Chrome trace of torch.profiler "
     "(RecursionError"),
    ("trace_report", ["{t}/nan_trace"], "'ProfilerStep#1' has ts nan and dur 5, not a time"),
    ("trace_report", ["{t}/inf_trace"], "'ProfilerStep#1' has ts 1 and dur inf, not a time"),
    ("trace_report", ["{t}/huge_trace"], "rank0.pt.trace.json is 2,147,483,649 bytes, more than a trace of a few"),
]


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar: error: "), err
    return lines[0]


@pytest.mark.parametrize("name, argv, fragment", CASES, ids=[f"{c[0]}: {c[2][:48]}" for c in CASES])
def test_a_script_refuses_bad_input_in_one_line_with_exit_2(t, name, argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        SCRIPTS[name].main([a.format(t=t) for a in argv])
    line = one_line(capsys.readouterr().err)
    assert e.value.code == 2 and fragment.format(t=t) in line, line
    assert "fewer than one window" not in line  # eval's --seq-len -4: the range is checked first


def test_each_script_as_a_program_exits_2_with_one_line_and_no_traceback(t):
    """One case per script through `python scripts/X.py`, all at once (most import torch)."""
    cases = {"plan": (["--gpu-memory", "80"], "has no unit"),
             "convert": (["import", f"{t}/hf_escape", f"{t}/out"], "leads outside"),
             "sample": ([f"{t}/climbs"], "leads outside"),
             "eval": ([f"{t}/run", "--data", f"{t}/me"], "links back to"),
             "trace_report": ([f"{t}/fifo"], "is not a folder"),
             "train_ft": (["--groups", "1"], "give 2 or more")}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    running = {name: subprocess.Popen([sys.executable, str(script_path(name)), *argv], cwd=t, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (argv, _) in cases.items()}
    for name, process in running.items():
        out, err = process.communicate(timeout=600)  # generous: a loaded machine
        assert process.returncode == 2 and out == "", (name, out, err)
        assert cases[name][1] in one_line(err), (name, err)


def test_plan_py_calibrate_ends_a_run_of_train_py_that_fails_in_one_line(tmp_path):
    """A layout train.py refuses (past plan.py's own checks: here, called directly) was a CalledProcessError."""
    with pytest.raises(SystemExit, match=r"^minipar: error: train.py --tp 3 stopped with exit 1: --tp 3 does not "
                                         r"divide the model's 4 attention heads"):
        SCRIPTS["plan"].measured_step("--tp 3", 6, tmp_path)


def test_the_same_scripts_run_with_good_input(t, capsys):
    """The checks refuse only what is wrong: the checkpoint samples and evaluates, the folder converts."""
    assert SCRIPTS["sample"].main([str(t / "run"), "--prompt", "def", "--tokens", "4"]).startswith("def")
    assert SCRIPTS["sample"].main([str(t / "run"), "--prompt", "def", "--tokens", "4", "--temperature", "0.001",
                                   "--seed", str(2**64 - 1)]).startswith("def")  # the bounds themselves
    loss, perplexity = SCRIPTS["eval"].main([str(t / "run"), "--data", str(TEXT), "--max-windows", "2",
                                             "--tokenizer", str(t / "tok.json")])
    assert 0 < loss < 10 and perplexity > 1
    assert SCRIPTS["convert"].main(["import", str(t / "hf"), str(t / "imported")]).name == "step_000000"
    assert capsys.readouterr().err == ""


def test_a_toml_file_that_is_not_utf8_is_named_and_so_is_a_fifo(t):
    with pytest.raises(ConfigError, match=r"--config .*latin1.toml is not UTF-8 \(byte \d+ is 0x.*\): TOML files"):
        parse_args(["--config", str(t / "latin1.toml")])
    with pytest.raises(ConfigError, match="fifo is not a regular file"):
        parse_args(["--config", str(t / "fifo")])


@pytest.mark.parametrize("kind, text, value", [
    (checks.positive_int, "3", 3), (checks.non_negative_int, "0", 0), (checks.positive_float, "0.5", 0.5),
    (checks.non_negative_float, "0", 0.0), (checks.fraction, "1", 1.0), (checks.byte_size, "80GB", 80 * 10**9),
    (checks.byte_size, "80GiB", 80 * 2**30), (checks.byte_size, "1.5 TB", 15 * 10**11),
    (checks.byte_size, "512mib", 512 * 2**20),
])
def test_argparse_types_take_values_in_their_range(kind, text, value):
    assert kind(text) == value and type(kind(text)) is type(value)


@pytest.mark.parametrize("kind, text, words", [
    (checks.positive_int, "0", "0 is out of range: give 1 or more"), (checks.positive_int, "1.5", "not a whole number"),
    (checks.positive_int, "x", "'x' is not a whole number"), (checks.non_negative_int, "-1", "give 0 or more"),
    (checks.positive_float, "0", "give a number above 0"), (checks.positive_float, "nan", "not a finite number"),
    (checks.positive_float, "-inf", "not a finite number"), (checks.non_negative_float, "-0.1", "give 0 or more"),
    (checks.fraction, "0", "a fraction above 0, at most 1"), (checks.fraction, "1.01", "at most 1"),
    (checks.byte_size, "80", "80 has no unit: give e.g. 80GB or 80GiB"), (checks.byte_size, "lotsGB", "not a size"),
    (checks.byte_size, "80XB", "not a size"), (checks.byte_size, "0GB", "1 byte or more"),
    (checks.byte_size, "-5GB", "1 byte or more"), (checks.byte_size, "1e999GB", "not a finite number"),
])
def test_argparse_types_refuse_values_outside_their_range_in_words(kind, text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        kind(text)


def test_file_and_folder_types_name_the_trap(t):
    assert checks.existing_file(str(t / "tok.json")) == t / "tok.json"
    assert checks.existing_folder(str(t / "me" / "me")) == t / "me" / "me"  # a link to a folder is one
    for path, words in ((t / "loop", "is a symlink loop"), (t / "fifo", "not a regular file"),
                        (t / "a_folder", "is a folder: give a file"), (t / "broken", "a broken link"),
                        (t / "missing", "no such file or directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            checks.existing_file(str(path))
    for path, words in ((t / "loop", "is a symlink loop"), (t / "tok.json", "is not a folder")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            checks.existing_folder(str(path))


def test_a_path_named_in_a_file_stays_in_its_folder(t):
    assert checks.inside(t, "a/b.safetensors", "index") == t / "a" / "b.safetensors"
    assert checks.inside(t, str(t / "x"), "index") == t / "x"  # absolute, but inside
    for escape in ("../x", "a/../../x", "/etc/passwd", ".", str(t.parent / "x")):
        with pytest.raises(checks.InputError, match="index: .* leads outside"):
            checks.inside(t, escape, "index")


def test_a_parser_error_is_one_line_naming_the_program():
    p = checks.Parser(prog="tool.py")
    p.add_argument("--n", type=checks.positive_int)
    with pytest.raises(checks.InputError, match=r"^argument --n: 0 is out of range: give 1 or more \(tool.py --help"):
        p.parse_args(["--n", "0"])


def test_a_step_script_run_without_torchrun_names_the_command_in_one_line(tmp_path):
    """`python scripts/course/step_06_pipeline.py` (exercise 6.2's old hint) once ended in torch's env://
    traceback; every multi-rank course script starts through course_common.start_gloo, which says
    how to launch it, from the script's own docstring."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "course" / "step_06_pipeline.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    command = ".venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_06_pipeline.py"
    said = "step_06_pipeline.py runs on several ranks: launch it with torchrun, e.g. "
    assert proc.stderr.splitlines() == [said + command]
