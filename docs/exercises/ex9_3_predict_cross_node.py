"""Exercise 9.3 (chapter 9, "The mesh"; chapter 8, "Choosing a layout"), predict: which groups
leave the node.

The same 16 ranks as exercise 9.1 (dp 2 x tp 2 x pp 2 x cp 2, tp varying fastest, then cp, dp,
pp) on two nodes of 8 GPUs (ranks 0-7 on node 0). Which kinds of group have members on both
nodes, so that their messages cross InfiniBand instead of NVLink? Write the list of their names.
The answer key is `MeshLayout` in minipar/mesh.py (its `groups` and `node`).

Check: make exercise N=9.3
"""

ANSWER = None  # a list of some of "tp", "cp", "dp", "pp"
