"""Prefill on the GPU over hypothesis-drawn tile shapes (BM, BN, BK, stages), not just the defaults: a small
ragged causal batch, paged (tensor copies where the tile allows them) or contiguous, against the float64
reference. Draws that spill are skipped (the CPU config tests own that question)."""
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cukv.dtypes import from_storage, nan_bits
from cukv.configs.prefill import HEAD_DIMS, PrefillConfig
from cukv.policy.prefill import tile_config
from cukv.testing import assert_close, random_prefill_case, reference_prefill

pytestmark = pytest.mark.gpu


def _valid_shapes():
    out = []
    for d, bm, bn, bk, s in itertools.product(HEAD_DIMS, (64, 128, 192), range(16, 129, 16), (64, 128, 192, 256),
                                              range(2, 9)):
        try:
            PrefillConfig("bfloat16", d, 16, bm, bn, bk, s)
        except ValueError:
            continue
        out.append((d, bm, bn, bk, s))
    return out


VALID = _valid_shapes()


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(VALID), dtype=st.sampled_from(("bfloat16", "float16")),
       page_size=st.sampled_from((16, 1, 0)), seed=st.integers(0, 2**32 - 1))
def test_prefill_tile_shapes_match_reference(shape, dtype, page_size, seed):
    import cupy as cp

    import cukv

    d, bm, bn, bk, stages = shape
    cfg = tile_config(dtype, d, page_size, bm, bn, bk, stages)  # tensor copies where the pages allow them
    rep = cfg.compiled.functions.get(cfg.name)
    assume(rep is None or not (rep.spills or rep.stack_frame))
    rng = np.random.default_rng(seed)
    # one token, a partial query tile over a short prefix, and several tiles over a prefix of partial KV tiles
    q_lens = [1, int(rng.integers(2, bm)), int(rng.integers(bm + 1, 3 * bm))]
    cache_lens = [int(rng.integers(0, 40)), int(rng.integers(0, bn)), int(rng.integers(bn, 3 * bn))]
    hq, hkv = 4, 2
    case = random_prefill_case(rng, q_lens=q_lens, cache_lens=cache_lens, num_qo_heads=hq, num_kv_heads=hkv,
                               head_dim=d, page_size=page_size or 16, dtype=dtype)
    pf = cukv.BatchPrefill(hq, hkv, d, page_size=page_size or None, dtype=dtype, config=cfg)
    pf.plan(case["q_offsets"], case["kv_lens"], mask="causal")
    kv = (case["cache"], case["table"]) if page_size else (case["k"], case["v"], case["kv_offsets_device"])
    out = cp.full(case["q"].shape, nan_bits(dtype), case["q"].dtype)  # NaN-poisoned: every row must be written
    lse = cp.full((case["q"].shape[0], hq), np.nan, cp.float32)
    pf.run(case["q"], kv, out=out, lse=lse)
    want_o, want_lse = reference_prefill(case, mask="causal")
    assert_close(from_storage(out.get(), dtype), want_o, dtype, name=f"{cfg.name} output")
    assert_close(lse.get(), want_lse, "float32", atol=2e-3, rtol=2e-3, name=f"{cfg.name} lse")
