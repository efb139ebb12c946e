"""The cell agent: one cell's engine (vLLM or mock), its role lifecycle, and its control API."""
