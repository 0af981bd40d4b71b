"""Host-side dtype helpers and the error messages users see (no GPU needed)."""
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukv.arrays import as_device, canonical_dtype
from cukv.dtypes import bf16_bits, bf16_to_float, from_storage, nan_bits, to_storage
from cukv.testing import assert_close


def _bf16_rne_reference(x: float) -> int:
    """bf16 bits of one float32, written out the long way: keep the top 16 bits and round the dropped 16 to
    nearest, ties to the even result."""
    u = int(np.array([x], np.float32).view(np.uint32)[0])
    if np.isnan(np.float32(x)):
        return None
    top, rest = u >> 16, u & 0xFFFF
    if rest > 0x8000 or (rest == 0x8000 and top & 1):
        top += 1
    return top & 0xFFFF


# --- bf16_bits


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_bf16_bits_matches_round_to_nearest_even(patterns):
    f = np.array(patterns, np.uint32).view(np.float32)
    got = bf16_bits(f)
    assert got.dtype == np.uint16
    for x, g in zip(f, got):
        want = _bf16_rne_reference(float(x))
        if want is None:  # NaN in, NaN out
            assert np.isnan(bf16_to_float(np.array([g]))[0])
        else:
            assert int(g) == want, f"{float(x)!r} (0x{int(np.float32(x).view(np.uint32)):08x}) -> 0x{int(g):04x}, want 0x{want:04x}"


@pytest.mark.parametrize("bits,expected", [
    (0x3F808000, 0x3F80),  # tie, even below: stays
    (0x3F818000, 0x3F82),  # tie, odd below: rounds up to even
    (0x3F808001, 0x3F81),  # just above the tie: up
    (0x3F807FFF, 0x3F80),  # just below the tie: down
    (0xBF818000, 0xBF82),  # negative tie, odd: magnitude up
    (0x7F7FFFFF, 0x7F80),  # largest float32 rounds to +inf
    (0xFF7FFFFF, 0xFF80),  # ... and its negative to -inf
    (0x7F800000, 0x7F80),  # +inf stays
    (0xFF800000, 0xFF80),  # -inf stays
    (0x00000001, 0x0000),  # smallest subnormal rounds to zero
    (0x80000000, 0x8000),  # -0 keeps its sign
])
def test_bf16_bits_edge_cases(bits, expected):
    x = np.array([bits], np.uint32).view(np.float32)
    assert int(bf16_bits(x)[0]) == expected


def test_bf16_bits_preserves_nan():
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    # NaN payloads that would round into the exponent (or wrap past 0xFFFF) must still be NaN
    x = np.concatenate([x, np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF80FFFF], np.uint32).view(np.float32)])
    back = bf16_to_float(bf16_bits(x))
    assert np.isnan(back[[0, 1, 3, 4, 5, 6]]).all()
    assert back[2] == 1.0


def test_bf16_bits_keeps_shape_of_scalars():
    assert bf16_bits(np.float32(1.0)).shape == ()
    assert to_storage(np.float64(1.0), "bfloat16").shape == to_storage(np.float64(1.0), "float16").shape


@given(st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=64))
def test_bf16_round_trip_of_representable_values(patterns):
    bits = np.array(patterns, np.uint16)
    f = bf16_to_float(bits)
    finite = ~np.isnan(f)
    again = bf16_bits(f)
    np.testing.assert_array_equal(again[finite], bits[finite])  # exact, including -0, +-inf, subnormals
    assert np.isnan(bf16_to_float(again[~finite])).all()


def test_storage_round_trip_and_nan_bits():
    x = np.array([[1.5, -2.25], [0.0, 1024.0]])
    for dt in ("bfloat16", "float16"):
        s = to_storage(x, dt)
        assert s.dtype == (np.uint16 if dt == "bfloat16" else np.float16)
        np.testing.assert_array_equal(from_storage(s, dt), x)
        assert from_storage(s, dt).dtype == np.float64
        assert np.isnan(from_storage(np.array([nan_bits(dt)]), dt)).all()


# --- assert_close


def test_assert_close_reports_worst_coordinates():
    e = np.zeros((3, 4, 5))
    a = e.copy()
    a[1, 2, 3] = 0.5   # the worst
    a[2, 0, 1] = 0.1
    with pytest.raises(AssertionError) as ei:
        assert_close(a, e, "float16", name="out")
    msg = str(ei.value)
    assert "worst" in msg
    assert "2 of 60" in msg
    assert msg.startswith("out:")
    lines = [ln for ln in msg.splitlines() if "at (" in ln]
    # NumPy 2 prints the indices as np.int64(1); accept that and plain 1
    coords = [tuple(int(v) for v in re.findall(r"(?:np\.int64\()?(\d+)\)?", ln.split("):")[0].split("at (")[1]))
              for ln in lines]
    assert coords[0] == (1, 2, 3)
    assert (2, 0, 1) in coords


def test_assert_close_passes_on_matching_infinities():
    e = np.array([[-np.inf, 1.0], [np.inf, -3.0]])
    a = e + np.array([[0.0, 1e-5], [0.0, -1e-5]])
    rel = assert_close(a, e, "float32", atol=1e-3, rtol=1e-3, name="lse")
    assert 0 <= rel < 1e-3
    assert_close(np.full(4, -np.inf), np.full(4, -np.inf), "float32")  # an all-empty row


@pytest.mark.parametrize("actual,expected", [
    (np.nan, 0.0),          # NaN never passes
    (np.inf, 0.0),
    (-np.inf, -1e30),       # infinite vs finite
])
def test_assert_close_rejects(actual, expected):
    with pytest.raises(AssertionError, match="worst"):
        assert_close(np.array([actual]), np.array([expected]), "float32")


_INF_TOL = ("the tolerance is atol + rtol * |expected| (cukv/testing.py assert_close, the `bad = ...` line); "
            "with an infinite or NaN expected value that bound is inf/NaN and `err > bound` is False, so any "
            "actual value passes against an expected -inf LSE (e.g. a kernel writing 0 for an empty row)")


@pytest.mark.parametrize("actual,expected", [
    (-np.inf, np.inf),      # opposite infinities
    (0.0, -np.inf),         # an empty row's LSE computed as 0
    (12.5, np.inf),
])
def test_assert_close_rejects_against_infinite_expected(actual, expected):
    with pytest.raises(AssertionError, match="worst"):
        assert_close(np.array([actual]), np.array([expected]), "float32")


@pytest.mark.parametrize("actual", [np.nan, 1.0])
def test_assert_close_rejects_nan_expected(actual):
    with pytest.raises(AssertionError):
        assert_close(np.array([actual]), np.array([np.nan]), "float32")


def test_assert_close_shape_mismatch_and_tolerance():
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros(3), np.zeros(4))
    assert_close(np.array([1.0 + 1.9e-2]), np.array([1.0]), "bfloat16")  # inside 2e-2 + 2e-2
    assert_close(np.array([1.0 + 7e-3]), np.array([1.0]), "float16")  # inside 4e-3 + 4e-3
    with pytest.raises(AssertionError):
        assert_close(np.array([1.0 + 9e-3]), np.array([1.0]), "float16")  # outside 4e-3 + 4e-3
    with pytest.raises(AssertionError):
        assert_close(np.array([1.0 + 1e-3]), np.array([1.0]), "bfloat16", atol=1e-4, rtol=0)


# --- dtype names and device arrays


@pytest.mark.parametrize("name,canonical", [
    ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
    ("float16", "float16"), (np.dtype(np.float16), "float16"), ("torch.bfloat16", "bfloat16"),
])
def test_canonical_dtype_accepts(name, canonical):
    assert canonical_dtype(name) == canonical


@pytest.mark.parametrize("bad", ["float32", "int8", "bfloat", np.dtype(np.float32)])
def test_canonical_dtype_rejects_naming_the_value(bad):
    with pytest.raises(TypeError, match=re.escape(repr(bad))):
        canonical_dtype(bad)
    with pytest.raises(TypeError, match=r"^k_dtype="):
        canonical_dtype(bad, "k_dtype")


def test_canonical_dtype_accepts_numpy_scalar_type():
    assert canonical_dtype(np.float16) == "float16"


def test_as_device_rejects_numpy_array():
    with pytest.raises(TypeError, match=r"^q"):
        as_device(np.zeros((2, 3), np.float16), "q")


def test_as_device_numpy_message_mentions_cupy_asarray():
    with pytest.raises(TypeError, match=re.escape("cupy.asarray(q)")):
        as_device(np.zeros((2, 3), np.float16), "q")


def test_as_device_rejects_other_objects():
    with pytest.raises(TypeError, match=r"k must be a CuPy array.*got list"):
        as_device([1.0, 2.0], "k")


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_batch_decode_rejects_a_non_bool_cluster_merge(bad):
    import cukv

    with pytest.raises(TypeError, match=re.escape(f"cluster_merge={bad!r} must be True or False")):
        cukv.BatchDecode(8, 2, 128, 16, cluster_merge=bad)


def test_paged_kv_check_names_the_wrong_types():
    from cukv.kvcache import check_paged_kv
    from cukv.policy.decode import decode_config

    with pytest.raises(TypeError, match="BatchDecode reads a PagedKVCache through a PageTable; got dict and list"):
        check_paged_kv("BatchDecode", decode_config(), 2, {}, [])


def test_check_aligned_names_the_argument_and_boundary():
    from types import SimpleNamespace

    from cukv.arrays import check_aligned

    check_aligned(SimpleNamespace(data=SimpleNamespace(ptr=0x7F0000000100)), "q", 16)
    with pytest.raises(ValueError, match=r"q starts at device address 0x7f0000000102, which is not 16-byte aligned"):
        check_aligned(SimpleNamespace(data=SimpleNamespace(ptr=0x7F0000000102)), "q", 16)
