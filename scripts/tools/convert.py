"""Convert Hugging Face Llama checkpoints to minipar's and back (minipar/extras/hf.py does the renaming).

    python scripts/tools/convert.py import HF_DIR OUT_DIR     # a LlamaForCausalLM folder -> OUT_DIR/step_000000
    python scripts/tools/convert.py export CKPT_DIR HF_DIR    # a minipar checkpoint -> config.json + model.safetensors

The imported checkpoint is an ordinary minipar one at step 0 (no optimizer state): train.py
--init-from OUT_DIR starts from it under any layout, and scripts/tools/sample.py and eval.py read it (give
--tokenizer HF_DIR/tokenizer.json). The exported folder loads with
`transformers.LlamaForCausalLM.from_pretrained(HF_DIR)`, and holds the checkpoint's tokenizer.json
if it has one; transformers is not needed to convert.

The target must be new or an empty folder, outside the source: the folder is built under a
temporary name beside it and renamed into place, so nothing a user has is overwritten or mixed
into, and a failed conversion leaves nothing behind.
"""

import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from minipar.extras.hf import export_hf, import_hf
from minipar.model import Llama
from minipar.ops import checkpoint_checks, run_folder
from minipar.ops.args import Parser, new_folder, refusals
from minipar.run import checkpoint
from minipar.run.config import TrainConfig


def check_weights(config, weights: dict, source) -> None:
    """Every parameter of the model the config describes, at its shape, and nothing else."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Llama(config).named_parameters()}
    missing, extra = sorted(shapes.keys() - weights.keys()), sorted(weights.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"{source}: the weights do not match config.json (missing {missing[:3]}, unexpected "
                         f"{extra[:3]})")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(weights[name].shape)}, config.json says {shape}")


def import_folder(hf_dir: str, out: str) -> Path:
    """OUT_DIR/step_000000 (OUT_DIR new: it becomes a run's --out folder)."""
    with new_folder(out, "import's OUT_DIR", source=hf_dir) as tmp:
        config, weights = import_hf(hf_dir)
        check_weights(config, weights, hf_dir)
        run = asdict(TrainConfig(model="imported", vocab_size=config.vocab_size,
                                 tie_embeddings=config.tie_embeddings))
        state = {"step": 0, "consumed": 0, "config": run, "model_config": asdict(config), "source": str(hf_dir)}
        step = checkpoint.save(tmp, 0, weights, {}, [], state)
    return Path(out).expanduser() / step.name


def export_folder(ckpt: str, hf_dir: str) -> Path:
    path = run_folder.resolve(ckpt, flag="export")
    with new_folder(hf_dir, "export's HF_DIR", source=ckpt) as tmp:
        config = checkpoint_checks.model_config_of(path, checkpoint_checks.verified(path))
        weights = load_file(path / "model.safetensors")
        check_weights(config, weights, path)
        export_hf(config, weights, tmp)
        if (path / "tokenizer.json").exists():  # verified with the rest: the text the model was trained on
            shutil.copyfile(path / "tokenizer.json", tmp / "tokenizer.json")
    return Path(hf_dir).expanduser()


def main(argv=None) -> Path:
    """Convert; a bad folder or file is one line (`minipar: error: ...`) and exit code 2."""
    p = Parser(prog="convert.py", description=__doc__.split("\n")[0])
    p.add_argument("direction", choices=["import", "export"])
    p.add_argument("source", help="import: a Hugging Face Llama folder; export: a minipar checkpoint or --out folder")
    p.add_argument("target", help="import: the minipar --out folder to write; export: the folder to write")
    with refusals():  # HFError, CheckpointError, InputError: one line naming the file
        args = p.parse_args(argv)
        done = (import_folder if args.direction == "import" else export_folder)(args.source, args.target)
    print(f"wrote {done}")
    return done


if __name__ == "__main__":
    main()
