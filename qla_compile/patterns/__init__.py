"""The eager GDN forms we recognise, declared as data: known functions (front door) and graph anchors (FX pass)."""
