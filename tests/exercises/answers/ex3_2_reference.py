"""Exercise 3.2, the estimator's bytes_sent (the ledger's figure)."""

from minipar.model import get_config
from minipar.planning.estimate import bytes_sent
from minipar.run.config import TrainConfig

_cfg = TrainConfig(model="small", dp=4, zero=3, seq_len=128, micro_batch=1, global_batch=4, dtype="float32")
ANSWER = sum(v for k, v in bytes_sent(get_config("small"), _cfg).items() if k.startswith("dp/")) / 2**20
