"""Exercise 6.4 (chapter 6, "Bubbles: formula and simulation"), explore: micro-batches vs bubble.

1F1B on p = 4 stages (F = 1, B = 2). Run this file: it simulates the schedule for m = 1..40
micro-batches and prints the idle fraction (as a decimal, and as the fraction it is). What is the
fewest micro-batches at which the bubble is under 10% (strictly: exactly 10% is not under)? What
does each extra micro-batch cost instead (chapter 6, "Activation memory"; and with a fixed global
batch, what happens to each micro-batch)?

    python docs/exercises/ex6_4_explore_microbatches.py

Check: make exercise N=6.4
"""

ANSWER = None  # the fewest micro-batches m with 1F1B's bubble at p = 4 under 10%

if __name__ == "__main__":
    from fractions import Fraction

    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate

    for m in range(1, 41):
        idle = simulate(build("1f1b", 4, m)).idle_fraction()  # unit costs: a ratio of small whole numbers
        print(f"m {m:>2}: bubble {idle:.3f} = {Fraction(idle).limit_denominator(1000)}")
