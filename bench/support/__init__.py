"""Load generators and rigs the benchmarks drive (tests may reuse them): the fake packer,
a deterministic scripted engine, the router rig, stand-in scheduler peers. Never test code."""
