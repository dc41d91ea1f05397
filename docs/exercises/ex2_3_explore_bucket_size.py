"""Exercise 2.3 (chapter 2, "Three tricks"), explore: bucket size vs messages.

DataParallel's `--bucket-mb` sets the bucket size. Run this file: for the small model in float32
it prints, for each bucket size, the all-reduces one step sends and their bytes. How many
all-reduces does a step send at --bucket-mb 0.25, at 1 and at 25? Do the total bytes change?
With chapter 1's latency of about 160 µs per all-reduce call (on 2 ranks), what does each bucket
size cost in latency alone, and what does a single bucket lose (hint: when can its all-reduce
start)?

    python docs/exercises/ex2_3_explore_bucket_size.py

Check: make exercise N=2.3
"""

ANSWER = None  # (all-reduces at --bucket-mb 0.25, at 1, at 25)

if __name__ == "__main__":
    from minipar.data_parallel import bucket_params
    from minipar.model import Llama, get_config

    params = list(reversed(list(Llama(get_config("small"), seed=0).parameters())))  # backward order
    for mb in (0.01, 0.05, 0.25, 1, 4, 25):
        sizes = [sum(p.numel() * p.element_size() for p in b) for b in bucket_params(params, mb)]
        print(f"--bucket-mb {mb:<5} {len(sizes):>4} all-reduces, {sum(sizes):,} bytes in all, "
              f"largest {max(sizes):,}")
