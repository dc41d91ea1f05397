"""Exercise 11.1, wrong: the library's parallelize module executed again from its source file."""

import minipar.parallelize

namespace: dict = {"__name__": "copy_of_parallelize"}
exec(compile(open(minipar.parallelize.__file__).read(), "parallelize", "exec"), namespace)  # noqa: S102, SIM115


def recompute_selectively(model):
    namespace["recompute_layers"](model, namespace["keep_expensive"])
