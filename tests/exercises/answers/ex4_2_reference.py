"""Exercise 4.2, the estimator's bytes, tp 4 over tp 2."""

from minipar.model import get_config
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig


def _tp_sent(tp):
    cfg = TrainConfig(model="small", tp=tp, seq_len=256, micro_batch=1, global_batch=1, dtype="float32")
    return sum(v for k, v in bytes_sent(get_config("small"), cfg).items() if k.startswith("tp/"))


ANSWER = _tp_sent(4) / _tp_sent(2)
