"""Where each parameter lives: one typed object per parameter, stated once, read by everyone.

The plain model's parameters are whole, and every rank of a data-parallel group holds the same
copy. Parallelism changes that in three ways, and each is a fact about one parameter:

    shards     the parameter is cut along a tensor dimension across the ranks of a mesh
               dimension: ("tp", 0) for a column-parallel weight, ("tp", 1) for a row-parallel one
    partial    every rank holds the whole parameter, but each rank's gradient is only part of
               the sum over a mesh dimension (a norm under sequence parallelism sees only its
               rank's tokens): the gradients are summed over it after backward
    grad_mean  the mesh dimensions over which its gradient is averaged: ("dp", "cp") for the
               dense model (every data and context replica saw different tokens)

`Placement` holds these with the single-device shape. `parallelize` (and the tensor-parallel
layers it installs) writes it; initialisation, gradient clipping, checkpoints, ZeRO's bucketing
and the gradient-sync wrappers (each bucket reduced over the group of its parameters'
grad_mean, its partial sums added first: `sync_partial_grads`) read it, through `placement_of(p)`.
A parameter no one placed is whole and dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipar.collectives import Group, all_reduce

DENSE = ("dp", "cp")  # what a dense parameter's gradient is averaged over


@dataclass(frozen=True)
class Placement:
    full_shape: tuple[int, ...]  # the single-device shape (before any padding of a shard)
    shards: tuple[tuple[str, int], ...] = ()  # (mesh dimension, tensor dimension) pairs
    partial: tuple[str, ...] = ()  # mesh dimensions over which the gradient is a partial sum
    grad_mean: tuple[str, ...] = DENSE  # mesh dimensions over which the gradient is averaged

    def dim_of(self, mesh_dim: str) -> int | None:
        """The tensor dimension that `mesh_dim` cuts, or None if its ranks hold the whole of it."""
        return next((t for m, t in self.shards if m == mesh_dim), None)


def placement_of(p: torch.Tensor) -> Placement:
    """p's placement; a parameter never placed is whole (its own shape, no shards, no partial sums)."""
    return getattr(p, "placement", None) or Placement(tuple(p.shape))


def place(p: torch.nn.Parameter, placement: Placement) -> torch.nn.Parameter:
    p.placement = placement
    return p


def sync_partial_grads(params, group: Group) -> None:
    """All-reduce, in one flat message, the gradients that are partial sums over `group`'s dimension
    (its name in Placement.partial: tp, for the norms under sequence parallelism, chapter 4).
    `params`: a module's, or any list of parameters (a ZeRO bucket's)."""
    params = params.parameters() if isinstance(params, torch.nn.Module) else params
    params = [p for p in params if group.name in placement_of(p).partial and p.grad is not None]
    if group.size == 1 or not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce(flat, group)
    for p, summed in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(summed.view_as(p))
