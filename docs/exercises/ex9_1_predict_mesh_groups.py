"""Exercise 9.1 (chapter 9, "The mesh"), predict: one rank's groups.

32 ranks as dp x tp x pp x cp (chapter 9 prints every group of 16 ranks as 2 x 2 x 2 x 2; yours
is another shape); `make exercise N=9.1` prints your shape and your rank (drawn from SEED below).
minipar numbers the ranks with tp varying fastest, then cp, then dp, then pp
(rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i). Which ranks share each kind of group with
your rank? Write the four lists. The answer key is `MeshLayout.groups` in minipar/mesh.py
(`make exercise` prints which are wrong).

Check: make exercise N=9.1
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # {"tp": [...], "cp": [...], "dp": [...], "pp": [...]}, each with your rank in it
