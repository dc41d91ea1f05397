"""Exercise 0.1, wrong: the estimator's per-layer and head figures (siblings of activation_bytes),
added up."""

from minipar.model import get_config
from minipar.planning.estimate import head_activation_bytes, layer_activation_bytes
from minipar.run.config import TrainConfig


def saved_activation_bytes(model, tokens):
    b, s = tokens.shape[0], tokens.shape[1] - 1
    c = get_config("tiny")
    cfg = TrainConfig(model="tiny", seq_len=s, micro_batch=b, global_batch=b, dtype="float32")
    return c.n_layers * layer_activation_bytes(c, cfg) + head_activation_bytes(c, cfg)
