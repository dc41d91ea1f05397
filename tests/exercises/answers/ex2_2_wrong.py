"""Exercise 2.2, a plausible wrong answer: right gradients, but one all-reduce per parameter
(the buckets are ignored)."""

from minipar.collectives import all_reduce


class BucketedGradSync:
    def __init__(self, model, group, bucket_bytes):
        def average(p):
            all_reduce(p.grad, group)
            p.grad.div_(group.size)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(average)

    def finish(self):
        pass
