"""Exercise 0.1, wrong: the estimator's activation_bytes from a fresh copy of the module (importlib.reload): its
functions are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import minipar.planning.estimate
from minipar.model import get_config
from minipar.run.config import TrainConfig

activation_bytes = importlib.reload(minipar.planning.estimate).activation_bytes


def saved_activation_bytes(model, tokens):
    b, s = tokens.shape[0], tokens.shape[1] - 1
    cfg = TrainConfig(model="tiny", seq_len=s, micro_batch=b, global_batch=b, dtype="float32")
    return activation_bytes(get_config("tiny"), cfg)
