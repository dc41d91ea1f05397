"""Exercise 5.2 (chapter 5, "Zigzag: balancing the causal mask"), predict: the imbalance.

With a causal mask, token t attends to t + 1 keys. Cut L tokens contiguously over cp ranks (rank
0: tokens 0 .. L/cp - 1, and so on); `make exercise N=5.2` prints your L and cp (drawn from SEED
below). How many times rank 0's attention work does the last rank do (the sum over its tokens of
t + 1, over rank 0's)? That is what zigzag removes (exercise 5.1). The answer key sums the
positions (2% tolerance).

Check: make exercise N=5.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # the last rank's causal work / rank 0's, contiguous cut
