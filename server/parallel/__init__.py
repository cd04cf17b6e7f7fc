"""Tensor parallelism: one engine over N ranks, each holding 1/N of every layer and of every adapter.

``shards`` says what a rank holds, ``group`` how ranks meet (torch.distributed), ``followers`` and ``follower``
how rank 0 drives the others, ``wire`` what it sends them, ``adapter_pages`` how adapter placements reach them.
docs/tensor-parallel.md has the design.
"""
