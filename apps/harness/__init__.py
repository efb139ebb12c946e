"""An example long-horizon agent environment and the harness that runs it against Gyre."""
