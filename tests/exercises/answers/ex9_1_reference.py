"""Exercise 9.1, an answer: rank 5's coordinates from the numbering, then every rank that differs in
one coordinate alone."""

ORDER = ("tp", "cp", "dp", "pp")  # fastest first: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i


def coordinates(rank, sizes):
    out = {}
    for d in ORDER:
        out[d], rank = rank % sizes[d], rank // sizes[d]
    return out


def rank_of(coords, sizes):
    rank = 0
    for d in reversed(ORDER):
        rank = rank * sizes[d] + coords[d]
    return rank


def group(rank, dim, sizes):
    """The ranks that differ from `rank` in `dim` alone."""
    c = coordinates(rank, sizes)
    return [rank_of({**c, dim: i}, sizes) for i in range(sizes[dim])]


def formula(v):  # a function of the variant (v.mesh, v.rank)
    return {d: group(v.rank, d, v.mesh) for d in ORDER}


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = {'tp': [2, 3], 'cp': [0, 2, 4, 6], 'dp': [2, 10], 'pp': [2, 18]}
