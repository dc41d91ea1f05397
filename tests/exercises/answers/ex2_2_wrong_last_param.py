"""Exercise 2.2, wrong (issue 40's walk-around): each bucket launched from the hook of its "last"
parameter (the last in reverse definition order), without counting which of its gradients are ready.
On a model whose backward finishes its gradients in reverse definition order it works; on the
checker's, where a weight defined first is used last and a tied weight is ready last, a bucket goes
out before all its gradients are there (a missing one is sent as zeros)."""

import torch

from minipar.collectives import all_reduce


class BucketedGradSync:
    def __init__(self, model, group, bucket_bytes):
        self.group, self.buckets, current, size = group, [], [], 0
        for p in reversed(list(model.parameters())):  # the order backward finishes them
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.ready = [set() for _ in self.buckets]
        self.launched = []  # (bucket, its flat buffer, the all-reduce's handle)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        i = self.bucket_of[id(p)]
        if p is self.buckets[i][-1]:  # "the last of the bucket": true only if backward keeps definition order
            buffer = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1)
                                for q in self.buckets[i]]).div_(self.group.size)
            self.launched.append((i, buffer, all_reduce(buffer, self.group, async_op=True)))

    def finish(self):
        for i, buffer, handle in self.launched:
            handle.wait()
            for p, averaged in zip(self.buckets[i], buffer.split([q.numel() for q in self.buckets[i]])):
                p.grad.copy_(averaged.view_as(p))
            self.ready[i].clear()
        self.launched = []
