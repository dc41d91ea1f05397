"""Exercise 7.3, the estimator's bytes, ep 8 over ep 2."""

from minipar.model import get_config
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig


def _ep_sent(ep):
    cfg = TrainConfig(model="small-moe", dp=ep, ep=ep, seq_len=256, micro_batch=1, global_batch=ep, dtype="float32")
    return sum(v for k, v in bytes_sent(get_config("small-moe"), cfg).items() if k.startswith("ep/"))


ANSWER = _ep_sent(8) / _ep_sent(2)
