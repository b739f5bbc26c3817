"""Speculative decoding over a target split across processes (Macs) with MLX's own distributed
layer: `mlx.launch` starts the ranks (ring over TCP, or JACCL over RDMA on Thunderbolt 5), the
target is split by pipeline or tensor parallelism (mlxspec.distributed.stage), rank 0 drafts and
decides, and each step it posts the other ranks their work in one small all-sum
(mlxspec.distributed.link). No transport of our own: MLX's groups carry everything.
"""

import mlx.core as mx

from ..backends.mlx.hidden_states import decoder_layers
from ..backends.mlx.target import STAGE, stage_of
from .link import DistributedError, Link
from .ranks import Follower, LeaderTarget, cache_slot, follow_generation, follower, leading
from .stage import (SHARDINGS, Stage, check_caches_per_layer, layer_split, split_pipeline,
                    split_tensors)


def launched() -> bool:
    """Whether this process is one of several ranks (started by mlx.launch)."""
    return mx.distributed.is_available() and mx.distributed.init().size() > 1


def barrier(group) -> None:
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    except RuntimeError as err:
        from .link import lost

        raise lost(err, group.rank()) from None


def check_sharding(sharding: str) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; choose from {', '.join(SHARDINGS)}")
    return sharding


def split_model(model, sharding: str, group) -> Stage:
    """Split a lazily loaded model for this rank and read only its own weights."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..backends.mlx.target import is_recurrent, untrimmable_caches

    caches = make_prompt_cache(model)
    recurrent = [c for c in caches if is_recurrent(c)]
    odd = untrimmable_caches([c for c in caches if not is_recurrent(c)])
    if odd:
        raise ValueError(f"a split target needs caches that roll back; this model has "
                         f"{', '.join(odd)}")
    if sharding == "pipeline":
        check_caches_per_layer(caches, decoder_layers(model))
    if recurrent and sharding == "tensor":
        raise ValueError("tensor parallelism over a hybrid target (recurrent layers) is not "
                         "supported; use --shard pipeline")
    if _unmixed(model, caches):
        # Each rank rolls back its own recurrent layers by re-running their recorded updates;
        # a layer whose mixer mlxspec cannot find would need the whole model re-run, which no
        # rank holds.
        raise ValueError("a split target's recurrent layers must be of a kind mlxspec re-runs "
                         "alone (Gated DeltaNet, Mamba-2, short convolutions); this model's are "
                         "not")
    stage = (split_pipeline if sharding == "pipeline" else split_tensors)(model, group, caches)
    mx.eval(model.parameters())
    object.__setattr__(model, STAGE, stage)
    stage.link = Link(group)
    return stage


def _unmixed(model, caches: list) -> bool:
    """Whether a recurrent layer has no mixer that state_mixers finds, or several sharing one
    state (rwkv7's time and channel mixing), whose replays no rank can tell apart. Layers and
    caches are paired where they line up, as a pipeline needs; otherwise it asks whether none
    is found at all."""
    from mlx_lm.models.cache import CacheList

    from ..backends.mlx.target import is_recurrent, state_mixers

    found: dict[int, int] = {}
    for layer, _ in state_mixers(model):
        found[id(layer)] = found.get(id(layer), 0) + 1
    layers = decoder_layers(model)
    if len(layers) != len(caches):
        return not found
    return any(is_recurrent(c) and (not found.get(id(layer)) or found[id(layer)] > 1
                                    and not isinstance(c, CacheList))
               for layer, c in zip(layers, caches))


__all__ = ["DistributedError", "Follower", "LeaderTarget", "Link", "SHARDINGS", "STAGE", "Stage",
           "barrier", "cache_slot", "check_sharding", "follow_generation", "follower",
           "launched", "layer_split", "leading", "split_model", "stage_of"]
