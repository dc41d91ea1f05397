"""Exercise 9.3 (chapter 9, "The mesh"; chapter 8, "Choosing a layout"), predict: which groups
leave the node.

32 ranks as dp x tp x pp x cp (tp varying fastest, then cp, dp, pp, as in exercise 9.1) on nodes
of n GPUs (ranks 0 .. n-1 on node 0); `make exercise N=9.3` prints your shape and n (drawn from
SEED below). Which kinds of group have members on two nodes, so that their messages cross
InfiniBand instead of NVLink? Write the list of their names. The answer key is `MeshLayout` in
minipar/mesh.py (its `groups` and `node`).

Check: make exercise N=9.3
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # a list of some of "tp", "cp", "dp", "pp"
