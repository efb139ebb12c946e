"""Applications built on the Gyre library and services: the local launcher (``apps.launch``),
the demo (``apps.demo``), the example harness and environment (``apps.harness``) and the tiny
model builder (``apps.model``). Nothing under ``gyre/`` or ``services/`` imports them."""
