"""Exercise 5.2 (chapter 5, "Zigzag: balancing the causal mask"), predict: the imbalance.

With a causal mask, token t attends to t + 1 keys. Cut 1,024 tokens contiguously over cp = 4
ranks (rank 0: tokens 0-255, rank 3: tokens 768-1023). How many times rank 0's attention work
does rank 3 do (the sum over its tokens of t + 1, over rank 0's)? That is what zigzag removes
(exercise 5.1). The answer key sums the positions (2% tolerance).

Check: make exercise N=5.2
"""

ANSWER = None  # rank 3's causal work / rank 0's, contiguous cut
