"""Exercise 2.2, wrong: ZeRO's bucket_plan (a sibling of bucket_params) makes the buckets."""

import torch

from minipar.collectives import all_reduce
from minipar.zero import bucket_plan


def bucket_params(params, bucket_mb):
    return [chunk for _, _, chunk in bucket_plan([{"params": params}], bucket_mb)]


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
