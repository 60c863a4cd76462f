"""What a GDN region looks like in a dynamo FX graph, declared as data (op names, not code shapes).

Names are matched against ``call_function`` targets' ``__name__`` and ``call_method`` method names.
"""
from __future__ import annotations

#: The anchor: a cumulative sum of log gates over the chunk axis ...
CUMSUM = frozenset({"cumsum"})
#: ... whose pairwise differences (reached through these view ops) ...
PAIRWISE_VIEWS = frozenset({"unsqueeze", "getitem", "view", "reshape", "expand", "transpose", "permute", "rearrange"})
#: ... are subtracted, masked and exponentiated.
PAIRWISE_MASKS = frozenset({"masked_fill", "masked_fill_", "tril", "triu", "where", "float", "to", "mul"})
SUB = frozenset({"sub", "sub_"})
EXP = frozenset({"exp", "exp_"})

#: Shape-only or dtype-only ops; an output may be extended through these (they never change values).
LAYOUT = frozenset({
    "transpose", "permute", "reshape", "view", "contiguous", "to", "float", "type_as", "unsqueeze", "squeeze",
    "flatten", "unflatten", "expand", "expand_as", "getitem", "clone", "movedim", "swapaxes", "rearrange",
})

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
    "logical_not", "invert", "bitwise_not", "and_", "bool", "squeeze", "select",
})

#: In-place ops: they mutate their first argument.
MUTATING = frozenset({"setitem", "masked_fill_", "copy_", "zero_", "add_", "mul_", "sub_", "exp_", "iadd", "imul",
                      "isub"})
