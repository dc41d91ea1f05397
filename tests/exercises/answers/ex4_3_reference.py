"""Exercise 4.3, the estimator's held_bytes at tp 2."""

from minipar.model import get_config
from minipar.planning.estimate import held_bytes
from minipar.run.config import TrainConfig

_cfg = TrainConfig(model="small", tp=2, seq_len=256, micro_batch=1, global_batch=1, dtype="float32")
ANSWER = held_bytes(get_config("small"), _cfg)["params"] / 2**20
