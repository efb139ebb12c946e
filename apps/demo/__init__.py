"""`make demo`: the real system end to end on this machine (see runner.py)."""
