"""Every GPU of a host: one process runs decode, prefill, append and merge on device 0, then device 1, then device 0
again, against the float64 reference. Kernels are loaded once per device (with each device's dynamic shared-memory
opt-in); op objects keep their plan-time buffers on the device they were planned on.

Needs two GPUs: ``pytest -m gpu tests/test_multi_gpu.py`` on a two-GPU machine (skipped elsewhere)."""
import numpy as np
import pytest

import cukv
from cukv import reference
from cukv.dtypes import from_storage, to_storage
from cukv.testing import assert_close, random_decode_case, random_prefill_case, reference_decode, reference_prefill


def _device_count() -> int:
    from cukv.device import device_count

    return device_count()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_device_count() < 2, reason="needs two CUDA GPUs (this process sees fewer)")]

#: device 0, then 1, then 0 again: the second visit reuses what the first loaded
DEVICES = (0, 1, 0)


def _on(dev):
    import cupy as cp

    return cp.cuda.Device(dev)


def _devices_of(*arrays):
    return {int(a.device.id) for a in arrays}


@pytest.mark.parametrize("stages", [0, 3], ids=["registers", "ring"])
@pytest.mark.parametrize("num_splits", [None, 1, 4], ids=["auto", "one", "four"])
def test_decode_on_every_device(rng, stages, num_splits):
    shared = cukv.BatchDecode(8, 2, 128, 16, "bfloat16", stages=stages)  # re-planned on each device
    planned = {}  # one object per device, planned once, run again on the second visit
    for dev in DEVICES:
        with _on(dev):
            case = random_decode_case(rng, batch=3, lengths=[1, 517, 1100], num_qo_heads=8, num_kv_heads=2,
                                      head_dim=128, page_size=16)
            ref_o, ref_lse = reference_decode(case)
            if dev not in planned:
                planned[dev] = cukv.BatchDecode(8, 2, 128, 16, "bfloat16", stages=stages).plan(3, 1100, num_splits)
            shared.plan(3, 1100, num_splits)
            for dec in (planned[dev], shared):
                out, lse = dec.run(case["q"], case["cache"], case["table"], return_lse=True)
                assert _devices_of(out, lse) == {dev}
                assert_close(from_storage(out.get(), "bfloat16"), ref_o, "bfloat16", name=f"out on device {dev}")
                assert_close(lse.get(), ref_lse, "float32", atol=2e-3, rtol=2e-3, name=f"lse on device {dev}")


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "contiguous"])
def test_prefill_on_every_device(rng, page_size):
    planned = {}
    for dev in DEVICES:
        with _on(dev):
            case = random_prefill_case(rng, q_lens=[17, 300, 1], cache_lens=[0, 40, 9], num_qo_heads=8,
                                       num_kv_heads=2, head_dim=128, page_size=16)
            kv = ((case["cache"], case["table"]) if page_size else
                  (case["k"], case["v"], case["kv_offsets_device"]))
            ref_o, ref_lse = reference_prefill(case)
            if dev not in planned:
                planned[dev] = cukv.BatchPrefill(8, 2, 128, page_size=page_size, dtype="bfloat16")
            pf = planned[dev]
            pf.plan(case["q_offsets"], case["kv_lens"])
            out, lse = pf.run(case["q"], kv, return_lse=True)
            assert _devices_of(out, lse) == {dev}
            assert_close(from_storage(out.get(), "bfloat16"), ref_o, "bfloat16", name=f"out on device {dev}")
            assert_close(lse.get(), ref_lse, "float32", atol=2e-3, rtol=2e-3, name=f"lse on device {dev}")


@pytest.mark.parametrize("fp8_prefill", ["fused", "dequantize_first", "convert_once"])
def test_fp8_prefill_gives_the_same_answer_on_every_device(fp8_prefill):
    """The FP8 strategies (TMA descriptors, workspaces, the persistent counter): the same inputs on each device
    give the same outputs as on device 0 (the float64 check of each strategy is test_fp8_prefill_gpu.py's)."""
    results = []
    for dev in DEVICES:
        with _on(dev):
            case = random_prefill_case(np.random.default_rng(7), q_lens=[200, 33], cache_lens=[0, 150],
                                       num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                       kv_dtype="fp8_e4m3", scale_granularity="token")
            pf = cukv.BatchPrefill(8, 2, 128, 16, "bfloat16", kv_dtype="fp8_e4m3", scale_granularity="token",
                                   fp8_prefill=fp8_prefill)
            pf.plan(case["q_offsets"], case["kv_lens"])
            assert pf.strategy == fp8_prefill
            out, lse = pf.run(case["q"], (case["cache"], case["table"]), return_lse=True)
            assert _devices_of(out, lse) == {dev}
            o = from_storage(out.get(), "bfloat16")
            assert np.isfinite(o).all() and np.isfinite(lse.get()).all()
            results.append((o, lse.get()))
    for dev, (o, lse) in zip(DEVICES[1:], results[1:]):
        assert_close(o, results[0][0], "bfloat16", name=f"out on device {dev} vs device 0")
        assert_close(lse, results[0][1], "float32", atol=1e-5, rtol=1e-5, name=f"lse on device {dev} vs device 0")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_append_on_every_device(rng, dtype):
    import cupy as cp

    for dev in DEVICES:
        with _on(dev):
            cache = cukv.PagedKVCache(6, 16, 2, 128, dtype=dtype, fill="nan")
            k = to_storage(rng.standard_normal((37, 2, 128)).astype(np.float32), dtype)
            v = to_storage(rng.standard_normal((37, 2, 128)).astype(np.float32), dtype)
            slots = rng.permutation(6 * 16)[:37].astype(np.int64)
            slots[5] = -1  # padding
            kp = from_storage(cache.k.get(), dtype)
            vp = from_storage(cache.v.get(), dtype)
            reference.append(kp, vp, from_storage(k, dtype), from_storage(v, dtype), slots)
            cukv.append_kv(cache, cp.asarray(k), cp.asarray(v), cp.asarray(slots))
            assert _devices_of(cache.k, cache.v) == {dev}
            np.testing.assert_array_equal(from_storage(cache.k.get(), dtype), kp)
            np.testing.assert_array_equal(from_storage(cache.v.get(), dtype), vp)


def test_merge_on_every_device(rng):
    import cupy as cp

    from cukv import merge_states, merge_states_n

    for dev in DEVICES:
        with _on(dev):
            v = rng.standard_normal((3, 29, 4, 128)).astype(np.float32)
            s = (rng.standard_normal((3, 29, 4)) * 4).astype(np.float32)
            vs = to_storage(v, "bfloat16")
            ref_o, ref_l = reference.merge_states(list(from_storage(vs, "bfloat16")), list(s.astype(np.float64)))
            out, lse = merge_states_n(cp.asarray(vs), cp.asarray(s))
            assert _devices_of(out, lse) == {dev}
            assert_close(from_storage(out.get(), "bfloat16"), ref_o, "bfloat16", name=f"merge_n on device {dev}")
            assert_close(lse.get(), ref_l, "float32", atol=1e-5, rtol=1e-5, name=f"lse on device {dev}")
            ref2, _ = reference.merge_states(list(from_storage(vs[:2], "bfloat16")), list(s[:2].astype(np.float64)))
            o2, _ = merge_states(cp.asarray(vs[0]), cp.asarray(s[0]), cp.asarray(vs[1]), cp.asarray(s[1]))
            assert_close(from_storage(o2.get(), "bfloat16"), ref2, "bfloat16", name=f"merge on device {dev}")


def test_kernels_are_loaded_once_per_device():
    """The prefill kernel needs more than the default 48 KB of dynamic shared memory: each device's copy of the
    function carries the opt-in."""
    import cupy as cp

    pf = cukv.BatchPrefill(8, 2, 128, 16, "bfloat16")
    pf.plan(np.array([0, 64], np.int32), np.array([64], np.int32))
    cfg = pf.kernel_config
    assert cfg.smem_bytes > 48 * 1024
    fn = cfg.compiled.function(cfg.name, cfg.smem_bytes)
    per_device = [fn.on_device(d) for d in (0, 1)]
    assert per_device[0] is not per_device[1] and fn.on_device(0) is per_device[0]
    for d in (0, 1):
        with cp.cuda.Device(d):
            assert fn.max_dynamic_shared_size_bytes >= cfg.smem_bytes


@pytest.mark.parametrize("op", ["decode", "prefill", "mla"])
def test_run_on_another_device_than_the_plan_is_refused(rng, op):
    import cupy as cp

    from cukv.errors import DeviceMismatchError

    with _on(0):
        if op == "mla":
            obj = cukv.BatchMLADecode(16).plan([100, 7])
        elif op == "decode":
            obj = cukv.BatchDecode(8, 2, 128, 16, "bfloat16").plan(3, 1100)
        else:
            obj = cukv.BatchPrefill(8, 2, 128, 16, "bfloat16")
            case0 = random_prefill_case(rng, q_lens=[17, 3], cache_lens=[0, 40], num_qo_heads=8, num_kv_heads=2,
                                        head_dim=128, page_size=16)
            obj.plan(case0["q_offsets"], case0["kv_lens"])
    with _on(1):
        if op == "mla":
            cache = cukv.MLAKVCache(num_pages=4, page_size=64, dtype="bfloat16", fill="zeros")
            table = cp.asarray(np.array([[0, 1], [2, 3]], np.int32))
            call = lambda: obj.run(cp.zeros((2, 1, 16, 576), cp.uint16), cache, table)  # noqa: E731
        elif op == "decode":
            case = random_decode_case(rng, batch=3, lengths=[1, 517, 1100], num_qo_heads=8, num_kv_heads=2,
                                      head_dim=128, page_size=16)
            call = lambda: obj.run(case["q"], case["cache"], case["table"])  # noqa: E731
        else:
            case = random_prefill_case(rng, q_lens=[17, 3], cache_lens=[0, 40], num_qo_heads=8, num_kv_heads=2,
                                       head_dim=128, page_size=16)
            call = lambda: obj.run(case["q"], (case["cache"], case["table"]))  # noqa: E731
        with pytest.raises(DeviceMismatchError, match="planned on device 0 and is run on device 1"):
            call()
