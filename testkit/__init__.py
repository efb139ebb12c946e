"""The test kit: every fake, rig and PKI helper that tests and benchmarks share, in the
spirit of ``temporalio.testing``. The fake packer, a deterministic scripted engine, the
router rig, stand-in scheduler peers, link proxies, process helpers, the session's test PKI
(``testkit.tls``) and the leader helpers.

Importable by ``tests/`` and ``bench/``; never by the product (``gyre``, ``services``,
``apps``, ``sim``: ``tests/unit/test_layers.py``). It imports no test module, and no test
module imports another: what two tests share lives here or in a ``conftest.py``."""
