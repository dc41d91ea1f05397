"""Exercise 6.2, the library's answer: GPipe's bubble formula (p-1)/(m+p-1)."""

from minipar.pipeline.schedules import bubble_formula

ANSWER = bubble_formula(4, 8)
