"""Exercise 8.3, the planner's clock."""

from minipar.model import get_config
from minipar.planning.planner import Cluster, step_time
from minipar.run.config import TrainConfig

_c = get_config("8b")
_cfg = TrainConfig(model="8b", dp=8, zero=3, seq_len=8192, micro_batch=1, global_batch=1024, dtype="bfloat16",
                   vocab_size=_c.vocab_size)
ANSWER = step_time(_c, _cfg, Cluster(8))["compute"]
