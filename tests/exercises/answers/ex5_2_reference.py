"""Exercise 5.2, an answer: rank r holds tokens r c .. (r+1) c - 1 (c = seq_len / cp), whose work is
the sum of t + 1 = c (r c + (c + 1) / 2): the last rank's over rank 0's."""


def formula(v):  # a function of the variant (v.cp, v.seq_len)
    c = v.seq_len // v.cp
    return ((v.cp - 1) * c + (c + 1) / 2) / ((c + 1) / 2)


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 14.884297520661157
