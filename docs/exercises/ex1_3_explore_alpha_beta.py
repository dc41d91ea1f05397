"""Exercise 1.3 (chapter 1, "Rooted operations, and the time a message takes"), explore: latency
or bandwidth?

Chapter 1 charges each message t = alpha + beta * n. A ring all-reduce of S bytes on N ranks is
2(N-1) messages in a row (ring steps), so it costs about alpha * 2(N-1) + beta * 2(N-1)/N * S;
the chapter fits that on 2 ranks, where a call is 2 steps. With its fit, rounded, alpha = 80 µs
per ring step (160 µs per call on 2 ranks) and beta = 0.55 ns per byte, run this file: it prints
the time for N = 2..32 ranks. For a 1 MiB all-reduce, and for a 64 MiB one, from how many ranks on
does it take at least twice as long as on 2 ranks? Why are the two answers so different?

    python docs/exercises/ex1_3_explore_alpha_beta.py

Check: make exercise N=1.3
"""

ANSWER = None  # (N for 1 MiB, N for 64 MiB): the first N whose time is at least twice N = 2's

if __name__ == "__main__":
    from minipar.collectives import ring_bytes_sent

    alpha, beta = 80e-6, 0.55e-9  # per ring step, per byte sent
    print(f"{'N':>4}{'1 MiB: ms':>12}{'64 MiB: ms':>12}")
    for n in range(2, 33):
        t = [alpha * 2 * (n - 1) + beta * ring_bytes_sent("all_reduce", s, n) for s in (2**20, 64 * 2**20)]
        print(f"{n:>4}{t[0] * 1e3:>12.3f}{t[1] * 1e3:>12.3f}")
