"""Exercise 2.2, wrong: the library's bucket_params from a fresh copy of the module (importlib.reload): its
functions are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import torch

import minipar.data_parallel
from minipar.collectives import all_reduce

bucket_params = importlib.reload(minipar.data_parallel).bucket_params


class BucketedGradSync:
    def __init__(self, model, group, bucket_bytes):
        params = list(reversed(list(model.parameters())))
        self.buckets, self.group, self.launched = bucket_params(params, bucket_bytes / 2**20), group, []
        self.ready = [set() for _ in self.buckets]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        i = self.bucket_of[id(p)]
        self.ready[i].add(id(p))
        if len(self.ready[i]) == len(self.buckets[i]):
            buffer = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]).div_(self.group.size)
            self.launched.append((i, buffer, all_reduce(buffer, self.group, async_op=True)))

    def finish(self):
        for i, buffer, handle in self.launched:
            handle.wait()
            for p, averaged in zip(self.buckets[i], buffer.split([q.numel() for q in self.buckets[i]])):
                p.grad.copy_(averaged.view_as(p))
        self.launched, self.ready = [], [set() for _ in self.buckets]
