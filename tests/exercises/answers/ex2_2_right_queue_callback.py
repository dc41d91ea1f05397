"""Exercise 2.2, right (as DDP does it): the buckets' all-reduces started from the hooks as each fills,
and waited for in a callback queued on autograd's engine (torch.autograd.Variable._execution_engine.
queue_callback), which runs once backward has finished every gradient; finish() has nothing left."""

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
        self.queued = False
        self.ready = [set() for _ in self.buckets]
        self.launched = []  # (bucket, its flat buffer, the all-reduce's handle)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        i = self.bucket_of[id(p)]
        self.ready[i].add(id(p))
        if len(self.ready[i]) == len(self.buckets[i]):
            buffer = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]).div_(self.group.size)
            self.launched.append((i, buffer, all_reduce(buffer, self.group, async_op=True)))
        if not self.queued:  # once per backward: wait when autograd's engine has finished every gradient
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)
            self.queued = True

    def _wait_all(self):
        for i, buffer, handle in self.launched:
            handle.wait()
            for p, averaged in zip(self.buckets[i], buffer.split([q.numel() for q in self.buckets[i]])):
                p.grad.copy_(averaged.view_as(p))
            self.ready[i].clear()
        self.launched, self.queued = [], False

    def finish(self):
        pass  # the callback did it, at the end of backward
