"""What a GDN region looks like in a dynamo FX graph, declared as data (op names, not code shapes).

Names are matched against ``call_function`` targets' ``__name__`` and ``call_method`` method names.
"""
from __future__ import annotations

#: The anchor: the in-chunk sums of the log gates (a ``cumsum``, or any op's output: ``regions.find_anchors``) ...
CUMSUM = frozenset({"cumsum"})
#: ... whose pairwise differences (reached through these view ops) ...
PAIRWISE_VIEWS = frozenset({"unsqueeze", "getitem", "view", "reshape", "expand", "transpose", "permute", "rearrange"})
#: ... are subtracted, masked (by a product, a select, an additive -inf mask, a clamp) and exponentiated.
PAIRWISE_MASKS = frozenset({"masked_fill", "masked_fill_", "tril", "triu", "where", "float", "to", "mul", "add",
                            "clamp", "clamp_max", "minimum"})
SUB = frozenset({"sub", "sub_"})
EXP = frozenset({"exp", "exp_"})
#: The other seed: a state decay, a product (``S * exp(g_t)``, ``einsum("bh,bhkv->bhkv", exp(g_t), S)``) ...
DECAY_PRODUCTS = frozenset({"mul", "mul_", "imul", "einsum"})
#: ... of a tensor with an exponential reached through these ops.
DECAY_VIEWS = PAIRWISE_VIEWS | frozenset({
    "to", "float", "half", "bfloat16", "type_as", "contiguous", "squeeze", "clone", "expand_as", "unbind", "select",
})

#: Shape-only or dtype-only ops; an output may be extended through these (they never change values).
LAYOUT = frozenset({
    "transpose", "permute", "reshape", "view", "contiguous", "to", "float", "type_as", "unsqueeze", "squeeze",
    "flatten", "unflatten", "expand", "expand_as", "getitem", "clone", "movedim", "swapaxes", "rearrange", "half",
    "bfloat16", "double", "type", "getattr",  # getattr: x.mT, x.T
})

#: Joins of tensors; a join of a single tensor (the outputs of a one-chunk loop) is a layout op too.
JOINS = frozenset({"cat", "stack"})

#: Elementwise maps a region may do to its gates alone; its g or beta may be taken after them.
GATE_MAPS = frozenset({"neg", "mul", "truediv", "float", "to", "type_as"})

#: Reshapes that split or merge heads; a region input is taken after them.
RESHAPES = frozenset({"reshape", "view", "unflatten", "flatten", "rearrange"})

#: Ops an eager GDN region may consist of (besides layout ops); growth stops at anything else, which then
#: becomes an input of the region.  No projections, convolutions or gate activations: those belong to the layer.
#: Constants built from the region's own tensors or shapes (``full_like``, ``eye``, ``arange``, ...) belong to it.
REGION_OPS = LAYOUT | CUMSUM | SUB | EXP | PAIRWISE_MASKS | frozenset({
    "add", "add_", "iadd", "neg", "mul_", "imul", "truediv", "div", "isub", "matmul", "bmm", "einsum", "sum",
    "rsqrt", "sqrt", "pow", "norm", "normalize", "linalg_solve_triangular", "solve_triangular", "inv",
    "linalg_inv", "inverse", "eye", "ones", "zeros", "zeros_like", "ones_like", "full_like", "empty_like",
    "new_zeros", "new_ones", "new_full", "new_empty", "arange", "full", "setitem", "pad", "cat", "stack", "repeat_interleave", "repeat", "diag_embed", "diagonal",
    "masked_fill_", "copy_", "zero_", "size", "sym_size", "mod", "floordiv", "sub", "eq", "lt", "le", "gt", "ge",
    "logical_not", "invert", "bitwise_not", "and_", "bool", "squeeze", "select", "unbind", "index_select",
    "linalg_solve", "solve", "linalg_vector_norm", "vector_norm", "clamp", "clamp_min", "clamp_max", "amax",
    "tril_", "triu_", "div_", "fill_", "neg_", "empty", "tensor", "scalar_tensor",
})
#: Ops returning a tuple whose elements the region may own (a sequence taken apart token by token).
OWNED_TUPLES = frozenset({"unbind"})

#: In-place ops: they mutate their first argument.
MUTATING = frozenset({"setitem", "masked_fill_", "copy_", "zero_", "add_", "mul_", "sub_", "exp_", "iadd", "imul",
                      "isub", "div_", "tril_", "triu_", "fill_", "neg_"})
