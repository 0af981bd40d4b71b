"""Side-by-side benchmarks (``python -m cukv bench ...``). PyTorch is used only here, as the peer."""
