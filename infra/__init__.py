"""The base layer, the machinery a fork rarely opens (infra/README.md: what each file owns). It imports nothing of
the model, the method or the run, which are one folder up (tests/test_layers.py)."""
