"""Exercise 0.2, the estimator's answer."""

from minipar.model import get_config
from minipar.planning.estimate import activation_bytes
from minipar.run.config import TrainConfig

ANSWER = activation_bytes(get_config("small"), TrainConfig(model="small", seq_len=256, micro_batch=8,
                                                           global_batch=8, dtype="float32")) / 2**20
