"""Exercise 0.1, wrong: the estimator's activation_bytes through its re-export in the planner."""

from minipar.model import get_config
from minipar.planning.planner import activation_bytes
from minipar.run.config import TrainConfig


def saved_activation_bytes(model, tokens):
    b, s = tokens.shape[0], tokens.shape[1] - 1
    cfg = TrainConfig(model="tiny", seq_len=s, micro_batch=b, global_batch=b, dtype="float32")
    return activation_bytes(get_config("tiny"), cfg)
