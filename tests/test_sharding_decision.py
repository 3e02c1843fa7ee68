"""`pk_jax.sharding.decide`: the lowering picked from partition specs (no devices needed)."""

import pytest

from pk_jax.sharding import decide

SIZES = {"data": 2, "tp": 4}


def pick(a, b, out, rows=(512,)):
    return decide(a, b, out, rows, SIZES)


@pytest.mark.parametrize("a, b, out, name, group, row_dim, out_spec", [
    # column-parallel, sequence-parallel input: gather rows, local columns
    ((("tp",), None), (None, "tp"), ("tp", None), "all_gather_matmul", ("tp",), 0, (((),), ("tp",))),
    # row-parallel, sequence-parallel output
    ((None, "tp"), ("tp", None), ("tp", None), "matmul_reduce_scatter", ("tp",), 0, ((("tp",),), ())),
    # row-parallel, replicated output
    ((None, "tp"), ("tp", None), (None, None), "matmul_all_reduce", ("tp",), None, (((),), ())),
    # data-parallel rows, column-parallel weights: nothing to communicate
    (("data", None), (None, "tp"), ("data", "tp"), "matmul", (), None, ((("data",),), ("tp",))),
    # data x tensor, sequence-parallel rows ('data', 'tp'): gather over tp only
    ((("data", "tp"), None), (None, "tp"), (("data", "tp"), None), "all_gather_matmul", ("tp",), 0,
     ((("data",),), ("tp",))),
    # data x tensor, row-parallel with a sequence-parallel output
    (("data", "tp"), ("tp", None), (("data", "tp"), None), "matmul_reduce_scatter", ("tp",), 0,
     ((("data", "tp"),), ())),
    # data x tensor, row-parallel all-reduce
    (("data", "tp"), ("tp", None), ("data", None), "matmul_all_reduce", ("tp",), None, ((("data",),), ())),
])
def test_forward_cases(a, b, out, name, group, row_dim, out_spec):
    d = pick(a, b, out)
    assert (d.name, d.group, d.row_dim) == (name, group, row_dim)
    rows, n = out_spec
    assert d.out_spec == (*rows, n)


def test_3d_rows_gather_the_sequence_dim():
    d = decide(("data", "tp", None), (None, "tp"), ("data", None, "tp"), (4, 512), SIZES)
    assert (d.name, d.row_dim, d.out_spec) == ("all_gather_matmul", 1, (("data",), (), ("tp",)))


def test_scatter_needs_divisible_rows():
    """Rows that cannot be split over the group fall back to the all-reduce."""
    assert pick((None, "tp"), ("tp", None), ("tp", None), rows=(6,)).name == "matmul_all_reduce"


def test_weight_gradient_of_sequence_parallel_column_layer_gathers_k():
    """dw = x^T @ dy: x^T (d, T) has k = T on tp, dy (T, f) has f on tp: gather x^T's k."""
    d = pick((None, "tp"), (None, "tp"), (None, "tp"))
    assert (d.name, d.gather_a_k, d.out_spec) == ("all_gather_k+matmul", ("tp",), ((), ("tp",)))


def test_weight_gradient_data_parallel_all_reduces_over_data():
    d = pick((None, ("data", "tp")), (("data",), "tp"), (None, "tp"))
    assert (d.name, d.group, d.gather_a_k) == ("all_gather_k+matmul_all_reduce", ("data",), ("tp",))


def test_k_sharded_on_one_operand_slices_the_other():
    """Only a's k is sharded and b does not use that axis: b is sliced, the partials all-reduced."""
    d = pick((None, "tp"), (None, None), (None, None))
    assert (d.name, d.group, d.b_spec) == ("matmul_all_reduce", ("tp",), (("tp",), ()))


def test_specs_never_repeat_an_axis():
    for a in [(None, "tp"), ("tp", None), (("data", "tp"), None), ("data", "tp")]:
        for b in [("tp", None), (None, "tp"), (None, None), ("data", "tp")]:
            for out in [(None, None), ("tp", None), (None, "tp"), (("data", "tp"), None)]:
                d = pick(a, b, out)
                for spec in (d.a_spec, d.b_spec, d.out_spec):
                    axes = [x for e in spec for x in e]
                    assert len(axes) == len(set(axes)), (a, b, out, d)
