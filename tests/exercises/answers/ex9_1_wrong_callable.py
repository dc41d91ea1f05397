"""Exercise 9.1, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""

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


def ANSWER(v):  # noqa: N802 - a function of the variant (v.mesh, v.rank)
    return {d: group(v.rank, d, v.mesh) for d in ORDER}
