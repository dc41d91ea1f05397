"""Exercise 9.1 (chapter 9, "The mesh"), predict: rank 5's groups.

16 ranks as dp 2 x tp 2 x pp 2 x cp 2. minipar numbers them with tp varying fastest, then cp,
then dp, then pp (rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i). Which ranks share each
kind of group with rank 5? Write the four lists. The answer key is `MeshLayout.groups` in
minipar/mesh.py (`make exercise` prints which are wrong).

Check: make exercise N=9.1
"""

ANSWER = None  # {"tp": [...], "cp": [...], "dp": [...], "pp": [...]}, each with rank 5 in it
