"""Local evaluation of a policy on the example task: a transformers sampler that speaks the
router's chat protocol (apps.eval.local) and bootstrap intervals (apps.eval.stats)."""
