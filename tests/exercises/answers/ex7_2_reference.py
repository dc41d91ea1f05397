"""Exercise 7.2, the estimator's bytes_sent on ep."""

from minipar.model import get_config
from minipar.planning.estimate import bytes_sent
from minipar.run.config import TrainConfig

_cfg = TrainConfig(model="small-moe", dp=4, ep=4, seq_len=256, micro_batch=1, global_batch=4, dtype="float32")
ANSWER = sum(v for k, v in bytes_sent(get_config("small-moe"), _cfg).items() if k.startswith("ep/")) / 2**20
