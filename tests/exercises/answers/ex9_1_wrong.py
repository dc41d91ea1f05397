"""Exercise 9.1, a plausible wrong answer: cp and dp swapped (dp thought to vary just after tp)."""

ANSWER = {"tp": [4, 5], "cp": [5, 9], "dp": [5, 7], "pp": [5, 13]}
