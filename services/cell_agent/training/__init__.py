"""Streaming elastic training of one cell: trainer, core optimizer, prefix groups, controller."""
