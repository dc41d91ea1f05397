"""Exercise 2.3, the library's buckets of the small model."""

from minipar.data_parallel import bucket_params
from minipar.model import Llama, get_config

_params = list(reversed(list(Llama(get_config("small"), seed=0).parameters())))
ANSWER = tuple(len(bucket_params(_params, mb)) for mb in (0.25, 1, 25))
