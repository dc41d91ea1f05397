"""Exercise 5.3, the estimator's bytes, cp 8 over cp 2."""

from minipar.model import get_config
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig


def _cp_sent(cp):
    cfg = TrainConfig(model="small", cp=cp, seq_len=256, micro_batch=1, global_batch=1, dtype="float32")
    return sum(v for k, v in bytes_sent(get_config("small"), cfg).items() if k.startswith("cp/"))


ANSWER = _cp_sent(8) / _cp_sent(2)
