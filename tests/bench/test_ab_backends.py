"""``python -m mtp_jax.bench ab``'s variant syntax (``mtp_jax.bench.ab_backends``): parsed and
checked before any model loads."""

import pytest

from mtp_jax.bench.ab_backends import parse_variant


def test_variants_parse_backends_and_constants():
    assert parse_variant("base:") == ("base", {}, {})
    name, backends, consts = parse_variant(
        "x:norm=xla,gemv=reduce,@pallas_kernels.paged_attention.pallas.NUM_SMS=64")
    assert (name, backends) == ("x", {"norm_backend": "xla", "gemv_backend": "reduce"})
    assert consts == {"pallas_kernels.paged_attention.pallas.NUM_SMS": 64}


@pytest.mark.parametrize("text,message", [
    ("b=norm=xla", "a name, then a colon"),  # no colon: would run the defaults under that name
    (":norm=xla", "a name, then a colon"),
    ("b:norm", "'norm' is not key=value"),
    ("b:foo=xla", "'foo' is not an op"),
    ("b:norm=bogus", "norm backend 'bogus' is unknown"),
    ("b:@nope.X=1", "not an attribute of an importable module"),
    ("b:@pallas_kernels.paged_attention.pallas.NUM_SMS=x", "is not an int"),
    ("b:@pallas_kernels.paged_attention.pallas.MAX_QUERY_ROWS=1.5", "is not an int"),
    ("b:@pallas_kernels.paged_attention.api.BACKENDS=1", "not an int; only integer"),
    ("b:@pallas_kernels.paged_attention.pallas.NOPE=1", "has no attribute 'NOPE'; its integer "
                                                        "constants: .*LONG_TABLE_KEYS"),
    ("b:@pallas_kernels.paged_attention.pallas.NUM_SMS=-5", "must be >= 0"),
    ("b:norm=pallas,norm=xla", "norm is given twice"),
    ("b:@pallas_kernels.paged_attention.pallas.NUM_SMS=1,@pallas_kernels.paged_attention."
     "pallas.NUM_SMS=2", "NUM_SMS is given twice"),
])
def test_bad_variants_name_the_part_and_the_syntax(text, message):
    with pytest.raises(ValueError, match=message):
        parse_variant(text)
