"""Eager entry points into other libraries, each optional and imported only with its library:
``fla`` (FLA's backend registry) and ``transformers`` (a reversible rebinding of its eager GDN functions)."""
