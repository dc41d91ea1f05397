"""train.py's command line: every flag, grouped as `--help` shows them (config.py's TrainConfig
holds the settings and checks them; `config.parser` passes its defaults in).

The shape flags override `--model`'s preset one size at a time; a flag left out is None here and
takes the preset's value in `TrainConfig.resolved`.
"""

from __future__ import annotations

import argparse

from minipar.context_parallel import CP_ATTENTION
from minipar.model import CONFIGS
from minipar.pipeline.schedules import SCHEDULES
from minipar.precision import DTYPES, GRAD_REDUCE, PRECISIONS
from minipar.run.args import HelpFormatter, Parser

# Flags that override one field of --model's preset (ModelConfig's field of the same name).
SHAPE_FLAGS = {"dim": "hidden size", "n_layers": "transformer blocks", "n_heads": "attention heads",
               "n_kv_heads": "key/value heads (grouped-query attention)", "ffn_dim": "MLP hidden size",
               "vocab_size": "the model's vocabulary: embedding rows, the tokenizer's must fit",
               "max_seq_len": "longest sequence the run may use"}
BPE_VOCAB = 4096  # the BPE's default size, when the model's vocabulary is larger
# Settings that act only with another (the help gives their defaults): set without it, to anything
# but the default, they would change nothing, and are refused, as --sp without --tp is.
ACTS_WITH = {"tp_overlap": "--tp 2 or more", "cp_attention": "--cp 2 or more", "schedule": "--pp 2 or more",
             "pp_layers": "--pp 2 or more", "zeropp": "--dp 2 or more", "aux_loss_coef": "a model with experts",
             "capacity_factor": "a model with experts", "replica_group_id": "--replica-groups 2 or more",
             "lighthouse": "--replica-groups 2 or more", "allow_config_change": "--resume",
             "eval_batches": "--val-fraction above 0", "token_dtype": ".bin token files as --data",
             "bpe_vocab": "a BPE trained on text --data (not .bin token files)"}


def add_model_flags(p: argparse.ArgumentParser, d) -> None:
    """--model, the shape flags that override its preset, the MoE weights, and where weights come from."""
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(CONFIGS), help=f"named model size: the preset the shape flags below "
                   f"override (default: --init-from's, else {d.model})")
    for name, what in SHAPE_FLAGS.items():
        g.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"{what} (default: the preset's)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                   help="the LM head shares the embedding table (default: the preset's; 1b ties)")
    g.add_argument("--aux-loss-coef", type=float, help=f"MoE load-balancing loss weight (default: {d.aux_loss_coef})")
    g.add_argument("--capacity-factor", type=float, help="MoE: tokens an expert takes, x its fair share (default "
                   f"{d.capacity_factor}: dropless, every token served)")
    g.add_argument("--init-from", default=None,
                   help="start from these weights at step 0 with a fresh optimizer: a checkpoint folder, e.g. one "
                   "scripts/convert.py import wrote from a Hugging Face model; without --model, the model's "
                   "preset and shape are the weights'")


def add_data_flags(p: argparse.ArgumentParser, d) -> None:
    """Where the tokens come from, how they are cut, and what is held out to validate on."""
    g = p.add_argument_group("data and validation")
    g.add_argument("--data", default=None, help="a text file or folder, or .bin token files (default: the Python "
                   "standard library)")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    g.add_argument("--bpe-vocab", type=int, help=f"tokens of the BPE trained on --data; it must fit in the "
                   f"model's vocabulary (default: the model's vocabulary, at most {BPE_VOCAB})")
    g.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: a BPE trained on --data)")
    g.add_argument("--token-dtype", default=d.token_dtype, choices=["uint16", "uint32"],
                   help=f"the ids' type in .bin token files (nanoGPT's format: a bare array; default: {d.token_dtype})")
    g.add_argument("--cache-dir", default=d.cache_dir, help="where tokenised data is kept")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="hold out this fraction of the documents (files) for validation, chosen by --seed")
    g.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="validation loss every N steps (0: at the end only; needs --val-fraction)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help=f"global batches of held-out windows per validation (default: {d.eval_batches})")


def add_precision_flags(g) -> None:
    """--precision, --dtype and --grad-reduce (how they combine: minipar/precision.py)."""
    g.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="fp32; bf16-autocast (fp32 weights, bf16 matmuls); bf16-mixed (the ZeRO paper's: bf16 "
                        "weights and gradients, fp32 master weights and Adam state: 16 bytes per parameter). "
                        "Default: fp32 on CPU, bf16-autocast on CUDA")
    g.add_argument("--dtype", default=None, choices=DTYPES, help="float64: all in "
                   "float64 (proofs; no --precision); float32 = --precision fp32, bfloat16 = bf16-autocast")
    g.add_argument("--grad-reduce", default=None, choices=GRAD_REDUCE,
                   help="bf16-mixed: gradients summed over ranks in bf16 (default: rounded at each of N-1 adds) "
                        "or fp32 (twice the bytes; the mean rounded once, within half a bf16 ulp)")


def add_layout_flags(p: argparse.ArgumentParser, d) -> None:
    """The parallel degrees and how each parallelism runs."""
    switch = argparse.BooleanOptionalAction
    g = p.add_argument_group("layout (dp x tp x pp x cp must equal the number of ranks)")
    for dim, help_ in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        g.add_argument(f"--{dim}", type=int, default=1, help=f"{help_}-parallel degree")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree, carved out of dp x cp (MoE models)")
    g.add_argument("--cp-attention", default=d.cp_attention, choices=CP_ATTENTION, help="context-parallel "
                   f"attention: K/V round a ring, or all-to-alls to whole heads (ulysses: heads / tp must divide by "
                   f"cp; default: {d.cp_attention})")
    g.add_argument("--sp", action=switch, default=False, help="sequence parallelism in the norm/residual regions "
                   "(tp > 1)")
    g.add_argument("--tp-overlap", action=switch, default=d.tp_overlap, help="tensor parallelism sends each "
                   "region's backward message while computing its weight gradients (bitwise the same step; with "
                   "--sp, one more all-gather of the input per region: only its shard is kept)")
    g.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help=f"pipeline schedule ({d.schedule})")
    g.add_argument("--virtual-stages", type=int, default=1, help="chunks per pipeline rank (interleaved)")
    g.add_argument("--pp-layers", default=None, help="layers per pipeline stage, e.g. 3,1 (the last stage also "
                   "carries the LM head and the loss); default: balanced, the extra ones to the first stages"),
    g.add_argument("--replica-groups", type=int, default=d.replica_groups, help="fault tolerance: the run is this "
                   "many replica groups, each a torchrun job with this layout inside, averaging gradients through "
                   "torchft; a lost group is dropped and rejoins with a peer's state (needs the torchft package)")
    g.add_argument("--replica-group-id", type=int, default=d.replica_group_id, help="which replica group this job is")
    g.add_argument("--lighthouse", default=None, help="HOST:PORT of torchft's lighthouse, where the replica groups "
                   "agree each step on who takes part")
    g.add_argument("--ranks-per-node", type=int, help="ranks that share a node (its fast links): the ledger counts "
                   "what crosses between nodes; less than the world simulates several nodes on one machine "
                   "(default: torchrun's LOCAL_WORLD_SIZE, else every rank on one node)")


def parser(d) -> argparse.ArgumentParser:
    """Every flag of train.py; `d`: the defaults (a TrainConfig)."""
    p = Parser(prog="train.py", formatter_class=HelpFormatter,
               description="Train a Llama-style model with minipar. Launch with torchrun for more than one rank.")
    switch = argparse.BooleanOptionalAction  # --sp and --no-sp: a flag can turn off what --config turned on
    p.add_argument("--config", help="a TOML file of these flags' settings (keys: the flags' names, e.g. "
                   "global-batch = 16); the flags given here override it")
    add_layout_flags(p, d)
    add_model_flags(p, d)
    add_data_flags(p, d)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step, all dp ranks")
    g.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward on one rank")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor, as a fraction of --lr")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's, on matrices only")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max global gradient norm (0: off)")
    g.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a collective or message may wait (a stopped or dead rank) before the run stops")
    g.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps,
                   help="stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)")
    g.add_argument("--seed", type=int, default=d.seed, help="weights and data order")
    add_precision_flags(g)
    g.add_argument("--bucket-mb", type=float, default=d.bucket_mb, help="data-parallel gradient bucket size")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage over the dp group: 0, 1, 2 or 3")
    g.add_argument("--zeropp", default=None, help="ZeRO++ on --zero 3: any of qwz,hpz,qgz (int8 forward gather, "
                   "backward gather inside the node, int4 gradients)")
    g.add_argument("--offload", action=switch, default=False, help="ZeRO 1-2: optimizer state and update on the CPU")
    g.add_argument("--recompute", action=switch, default=False, help="activation checkpointing per transformer layer")
    g.add_argument("--recompute-mlp", action=switch, default=False, help="selective activation checkpointing: "
                   "only each layer's MLP (or MoE block) is redone in backward; attention keeps its activations")
    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--out", default=None, help="checkpoint directory (default: runs/run_NNN, a new one)")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--save-on-interrupt", action=switch, default=True, help="Ctrl-C stops every rank after the "
                   "same step and saves it (default; --no-save-on-interrupt: unsaved); a second Ctrl-C stops at once")
    g.add_argument("--resume", default=None, help="a checkpoint folder, an --out folder (its newest that verifies), "
                   "or auto: --out's newest if it has one, else start fresh (for torchrun --max-restarts)")
    g.add_argument("--allow-config-change", action=switch, default=False,
                   help="--resume with another --data, --seq-len, --global-batch, --seed or learning-rate schedule "
                   "(default: off)")
    g.add_argument("--plan", action=switch, default=False, help="print what each rank will hold, and exit")
    g.add_argument("--print-config", action=switch, default=False, help="print the effective config as a TOML "
                   "file for --config (this run's folders and files left out), and exit")
    g.add_argument("--wandb", action=switch, default=True, help="log to wandb (offline unless you have logged in)")
    g.add_argument("--log-json", default=None, help="write one JSON object per step to this file (default: none)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="print a log line every N steps")
    g.add_argument("--profile-steps", default=None, help="A:B: torch.profiler over steps A to B (from 1) on every "
                   "rank, a Chrome trace per rank in --out/traces/steps_A-B (scripts/trace_report.py reads them)")
    return p
