"""The router: the harness-facing model API, tokenization, routing, reroute and turn records."""
