"""The torch reference backend: every op, on any device and dtype; the backend of last resort."""

from .attention import dense_attention, group_prob_sums, select_kv, sparse_attention
from .bitmask import decode_bitmask
from .pddp import pddp_groups, principal_direction, split_sizes

__all__ = [
    "decode_bitmask",
    "dense_attention",
    "group_prob_sums",
    "pddp_groups",
    "principal_direction",
    "select_kv",
    "sparse_attention",
    "split_sizes",
]
