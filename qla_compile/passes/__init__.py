"""Graph-level work of the backend: front-door substitutions and the FX pass that finds, proves and fuses GDN."""
