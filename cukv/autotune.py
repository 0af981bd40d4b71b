"""Placeholder until the autotuner lands: no tuned configs."""


def lookup(dtype, head_dim, page_size):
    return None
