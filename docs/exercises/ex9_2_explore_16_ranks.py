"""Exercise 9.2 (chapter 9, "The same 16 ranks, other layouts"), explore: memory against bytes.

Run this file: it prints, at three sequence lengths, the estimator's fullest rank and the bytes the
busiest rank sends per step for six layouts of 16 ranks (the small shape with a 256-word
vocabulary, float64, 16 sequences a step):

    A --dp 16                   B --dp 16 --zero 3              C --dp 8 --tp 2 --sp
    D --dp 4 --tp 2 --pp 2 --sp E --dp 2 --tp 2 --pp 2 --cp 2 --sp --zero 1
    F --dp 1 --tp 4 --pp 2 --cp 2 --sp

`make exercise N=9.2` gives your sequence length and a memory budget (drawn from SEED below): of
the layouts whose fullest rank fits the budget, which one's busiest rank sends the fewest bytes?
Then: which dimension buys the most memory per byte sent?

    python docs/exercises/ex9_2_explore_16_ranks.py

Check: make exercise N=9.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # "A" .. "F"

LAYOUTS = {"A": dict(dp=16), "B": dict(dp=16, zero=3), "C": dict(dp=8, tp=2, sp=True),
           "D": dict(dp=4, tp=2, pp=2, sp=True), "E": dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1),
           "F": dict(dp=1, tp=4, pp=2, cp=2, sp=True)}

if __name__ == "__main__":
    from minipar.layout import Layout
    from minipar.model import get_config
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.traffic import bytes_sent

    c = get_config("small", vocab_size=256)
    for seq_len in (32, 64, 128):
        print(f"--seq-len {seq_len}")
        for letter, layout in LAYOUTS.items():
            cfg = Layout(model="small", vocab_size=256, seq_len=seq_len, global_batch=16, micro_batch=1,
                         dtype="float64", **layout)
            busiest = max(sum(bytes_sent(c, cfg, r).values()) for r in range(cfg.pp))
            groups: dict[str, int] = {}
            for key, value in bytes_sent(c, cfg).items():  # pp rank 0's, by group
                groups[key.split("/")[0]] = groups.get(key.split("/")[0], 0) + value
            print(f"  {letter}: fullest rank {peak_bytes(c, cfg) / 2**20:6.2f} MiB; busiest rank sends "
                  f"{busiest / 2**20:6.2f} MiB (pp rank 0: " + ", ".join(f"{g} {v / 2**20:.2f}" for g, v in
                                                                         groups.items()) + ")")
