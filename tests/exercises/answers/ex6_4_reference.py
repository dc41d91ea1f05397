"""Exercise 6.4, an answer: 1F1B's bubble at p = 4 with F = 1, B = 2 is (p - 1)/(m + p - 1) = 3/(m + 3),
exactly; "under 10%" is strictly less, and 3/30 is exactly 10%: the fewest m is 28."""

from fractions import Fraction

ANSWER = next(m for m in range(1, 100) if Fraction(3, m + 3) < Fraction(1, 10))
