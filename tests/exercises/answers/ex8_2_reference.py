"""Exercise 8.2, read off scripts/plan.py: --dp 4 --cp 2 --zero 3 is its first line (chapter 8)."""

ANSWER = "B"
