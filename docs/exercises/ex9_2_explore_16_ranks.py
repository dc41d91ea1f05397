"""Exercise 9.2 (chapter 9, "The same 16 ranks, other layouts"), explore: the least memory.

Run this file: it prints the estimator's fullest rank and the bytes per group of six layouts of
16 ranks (the small shape with a 256-word vocabulary, float64, 16 x 32 tokens per step). Which
holds the least on its fullest rank? Which dimension buys the most memory per byte sent?

    A --dp 16                   B --dp 16 --zero 3              C --dp 8 --tp 2 --sp
    D --dp 4 --tp 2 --pp 2 --sp E --dp 2 --tp 2 --pp 2 --cp 2 --sp --zero 1
    F --dp 1 --tp 4 --pp 2 --cp 2 --sp

    python docs/exercises/ex9_2_explore_16_ranks.py

Check: make exercise N=9.2
"""

ANSWER = None  # "A" .. "F"

LAYOUTS = {"A": dict(dp=16), "B": dict(dp=16, zero=3), "C": dict(dp=8, tp=2, sp=True),
           "D": dict(dp=4, tp=2, pp=2, sp=True), "E": dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1),
           "F": dict(dp=1, tp=4, pp=2, cp=2, sp=True)}

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.estimate import bytes_sent, peak_bytes
    from minipar.run.config import TrainConfig

    c = get_config("small", vocab_size=256)
    for letter, layout in LAYOUTS.items():
        cfg = TrainConfig(model="small", seq_len=32, global_batch=16, micro_batch=1, dtype="float64", **layout)
        groups: dict[str, int] = {}
        for key, value in bytes_sent(c, cfg).items():
            groups[key.split("/")[0]] = groups.get(key.split("/")[0], 0) + value
        print(f"{letter}: fullest rank {peak_bytes(c, cfg) / 2**20:6.2f} MiB; sends "
              + ", ".join(f"{g} {v / 2**20:.2f} MiB" for g, v in groups.items()))
