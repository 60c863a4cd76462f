"""Entry points into other libraries, each optional and imported only with its library: ``fla`` (FLA's backend
registry, eager calls), ``fla_leaves`` (the leaves of FLA's short convolution and gated norm as ``qla::`` ops while
dynamo traces: no graph break there) and ``transformers`` (a reversible rebinding of its eager GDN functions)."""
